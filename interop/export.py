"""A meshlm checkpoint's parameters written as a Hugging Face directory that transformers' `from_pretrained`
loads, with the run's Hugging Face tokenizer files beside them; or a LoRA run's adapters as a PEFT adapter
directory (interop/peft_adapter.py). tools/export.py is its command line."""

from pathlib import Path

import jax

from configs.load import restored
from input_pipeline.token_files import read_meta
from input_pipeline.tokenizer import HF_SCHEME, HfTokenizer, load_tokenizer, run_tokenizer_name
from interop import hf_checkpoint, peft_adapter
from parallel.mesh import AXES
from training import lora
from training.checkpoint import Checkpoints
from training.state import base_params, param_count, plan
from training.step import model_entries, model_weights


def export(workdir: str, output: str, step: int | None = None, dtype: str = "float32", adapter: bool = False) -> str:
  """Export `step` (default: the newest) of `workdir`'s checkpoints to `output`, or with `adapter` its LoRA
  adapters as a PEFT adapter directory; returns what was written."""
  hf_checkpoint.check_new_directory(output)
  checkpoints = Checkpoints(workdir, every=0, keep=None)
  try:
    steps = checkpoints.steps()
    if not steps:
      raise ValueError(f"{checkpoints.directory} holds no checkpoint; train with "
                       f"--config.workdir={workdir} first.")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise ValueError(f"{checkpoints.directory} holds no step {step} (it holds {steps}).")
    # The parameters only need to fit one host.
    config = restored(checkpoints.stored_config(step), {f"mesh.{axis}": 1 for axis in AXES})
    layout = plan(config, jax.devices("cpu")[:1])
    # The weights the model computes with: LoRA's adapters merged into the frozen parameters.
    abstract = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                            layout.abstract_state, layout.state_shardings)
    if adapter and not layout.lora:
      raise ValueError(f"step {step} of {workdir} holds no LoRA adapters (lora.rank=0); export its weights "
                       "without --adapter.")
    frozen = lambda: base_params(layout, hf_checkpoint.open_init_from(config.init_from), config.seed)
    entries = jax.device_get(checkpoints.restore_weights(step, model_entries(abstract), frozen))
  finally:
    checkpoints.close()
  if adapter:
    tensors = peft_adapter.adapter_tensors(layout.model, layout.lora, entries["params"], entries[lora.ADAPTERS])
    base = config.init_from.removeprefix(HF_SCHEME) or None
    target = hf_checkpoint.write_directory(hf_checkpoint.check_new_directory(output), tensors,
                                           {"adapter_config.json": peft_adapter.config(layout.model, layout.lora,
                                                                                       tensors, base)},
                                           weights=peft_adapter.ADAPTER_WEIGHTS)
    return (f"exported the rank-{layout.lora.rank} adapters of step {step} of {workdir} "
            f"({len(tensors) // 2} modules) to {target}")
  params = jax.device_get(model_weights(layout, entries))
  folder = tokenizer_folder(config)
  beside = tuple(path for path in (folder / name for name in HfTokenizer.FILES) if path.is_file()) if folder else ()
  target = hf_checkpoint.write(output, layout.model, params, beside, dtype)
  return (f"exported step {step} of {workdir} ({layout.model.family}, {param_count(layout):,} parameters) "
          f"to {target}")


def tokenizer_folder(config) -> Path | None:
  """The folder of the Hugging Face tokenizer the run's text went through, if it went through one.

  Chosen as the run chose it (run_tokenizer_name), from the token data's meta.json rather than the
  token files, which an export may no longer have; only a Hugging Face tokenizer is loaded.
  """
  tokens = config.data.source == "tokens"
  data_tokenizer = read_meta(Path(config.data.path).expanduser())["tokenizer"] if tokens else "byte"
  name = run_tokenizer_name(config.init_from, data_tokenizer)
  return load_tokenizer(name).folder if name.startswith(HF_SCHEME) else None
