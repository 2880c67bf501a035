"""A saved run opened for inference: its config, layout and weights at a step, and its tokenizer (sample.py,
tools/evaluate.py)."""

from configs import load
from input_pipeline import data
from input_pipeline.tokenizer import run_tokenizer
from interop.hf_checkpoint import open_init_from
from training.checkpoint import Checkpoints
from training.state import abstract_inputs, base_params, plan
from training.step import model_entries, model_weights


def from_checkpoint(workdir: str, step: int = -1, mesh_sizes: dict | None = None, compute: str | None = None):
  """(config, layout, params, tokenizer, step) of a saved run, on `mesh_sizes` or the run's own mesh, computing
  in `compute` or the run's own precision; a LoRA run's adapters merged into the weights it started from."""
  checkpoints = Checkpoints(workdir, every=0, keep=None)
  try:
    steps = checkpoints.steps()
    if not steps:
      raise ValueError(f"{checkpoints.directory} holds no checkpoint; train with --config.workdir={workdir} first.")
    step = steps[-1] if step == -1 else step
    if step not in steps:
      raise ValueError(f"{checkpoints.directory} holds steps {steps}, not {step}.")
    config = load.restored(checkpoints.stored_config(step),
                           {**{f"mesh.{axis}": size for axis, size in (mesh_sizes or {}).items()},
                            **({"precision.compute": compute} if compute else {})})
    layout = plan(config)
    state = abstract_inputs(layout, config)[0]
    frozen = lambda: base_params(layout, open_init_from(config.init_from), config.seed)
    params = model_weights(layout, checkpoints.restore_weights(step, model_entries(state), frozen))
  finally:
    checkpoints.close()
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  return config, layout, params, run_tokenizer(config.init_from, split.tokenizer, split.origin), step
