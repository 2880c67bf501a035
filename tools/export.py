"""Writes a meshlm checkpoint as a Hugging Face directory that transformers' `from_pretrained` loads.

  python tools/export.py --workdir runs/finetune --output exported/finetune             # newest step
  python tools/export.py --workdir runs/finetune --step 200 --output exported/step200
  python tools/export.py --workdir runs/finetune --output exported/bf16 --dtype bfloat16    # half the bytes

Reads only the parameters of the step (not the optimizer state) onto one CPU
device, whatever mesh wrote them, and writes config.json and model.safetensors
(float32, or bfloat16 with --dtype=bfloat16) into a new directory, all at once or not at all. The model's shape
comes from the config saved with the checkpoint. When the run's text went
through a Hugging Face tokenizer (init_from=hf:DIR with DIR's tokenizer, or
token data prepared with --tokenizer=hf:DIR), its files are copied in too, so
transformers opens the export as a complete model. An --output that is not new or
empty, or that cannot be written, is refused in one line before the checkpoint
is read; a write that fails midway (a full disk) leaves nothing behind.
"""

import sys
from pathlib import Path

# `python tools/export.py` puts tools/ on sys.path, not the repo root that holds training/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # pylint: disable=wrong-import-position
from absl import app, flags, logging  # pylint: disable=wrong-import-position

from configs.base import base  # pylint: disable=wrong-import-position
from input_pipeline.token_files import read_meta  # pylint: disable=wrong-import-position
from input_pipeline.tokenizer import (  # pylint: disable=wrong-import-position
    HF_SCHEME, HfTokenizer, load_tokenizer, run_tokenizer_name)
from interop import hf_checkpoint  # pylint: disable=wrong-import-position
from parallel.mesh import AXES  # pylint: disable=wrong-import-position
from training.checkpoint import Checkpoints  # pylint: disable=wrong-import-position
from training.state import param_count, plan  # pylint: disable=wrong-import-position


def export(workdir: str, output: str, step: int | None = None, dtype: str = "float32") -> str:
  """Export `step` (default: the newest) of `workdir`'s checkpoints to `output`; returns what was written."""
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
    config = base()
    config.update(checkpoints.stored_config(step))
    for axis in AXES:  # the parameters only need to fit one host
      config.mesh[axis] = 1
    layout = plan(config, jax.devices("cpu")[:1])
    abstract = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                            layout.abstract_state["params"], layout.param_shardings)
    params = jax.device_get(checkpoints.restore_params(step, abstract))
  finally:
    checkpoints.close()
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


def define_flags():
  """Defines the command line; only when run, so importing export() leaves global flags alone."""
  flags.DEFINE_string("workdir", None, "The run's --config.workdir, holding checkpoints/.", required=True)
  flags.DEFINE_string("output", None, "A new (or empty) directory for config.json and model.safetensors.",
                      required=True)
  flags.DEFINE_integer("step", None, "The checkpoint step to export; default: the newest.")
  flags.DEFINE_enum("dtype", "float32", sorted(hf_checkpoint.EXPORT_DTYPES), "The stored weights' dtype.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  args = flags.FLAGS
  logging.set_verbosity(logging.WARNING)  # keep orbax's restore chatter off the console
  try:
    print(export(args.workdir, args.output, args.step, args.dtype))
  except ValueError as error:
    sys.exit(f"export.py: {error}")  # one line on stderr, exit status 1


if __name__ == "__main__":
  define_flags()
  app.run(main)
