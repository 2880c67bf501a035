"""Writes a meshlm checkpoint as a Hugging Face directory that transformers' `from_pretrained` loads.

  python tools/export.py --workdir runs/finetune --output exported/finetune             # newest step
  python tools/export.py --workdir runs/finetune --step 200 --output exported/step200
  python tools/export.py --workdir runs/finetune --output exported/bf16 --dtype bfloat16    # half the bytes
  python tools/export.py --workdir runs/lora --adapter --output exported/lora   # a LoRA run's PEFT adapter

Reads only the parameters of the step (not the optimizer state) onto one CPU
device, whatever mesh wrote them, and writes config.json and model.safetensors
(float32, or bfloat16 with --dtype=bfloat16) into a new directory, all at once or not at all. The model's shape
comes from the config saved with the checkpoint. When the run's text went
through a Hugging Face tokenizer (init_from=hf:DIR with DIR's tokenizer, or
token data prepared with --tokenizer=hf:DIR), its files are copied in too, so
transformers opens the export as a complete model. An --output that is not new or
empty, or that cannot be written, is refused in one line before the checkpoint
is read; a write that fails midway (a full disk) leaves nothing behind. A LoRA run exports its weights with the
adapters merged in, or with --adapter only the adapters, as a PEFT adapter directory (adapter_config.json and
adapter_model.safetensors) that peft.PeftModel.from_pretrained loads onto the model the run started from.
"""

import sys

from absl import app, flags, logging

from interop import hf_checkpoint
from interop.export import export


def define_flags():
  """Defines the command line; only when run, so importing this tool leaves global flags alone."""
  flags.DEFINE_string("workdir", None, "The run's --config.workdir, holding checkpoints/.", required=True)
  flags.DEFINE_string("output", None, "A new (or empty) directory for config.json and model.safetensors.",
                      required=True)
  flags.DEFINE_integer("step", None, "The checkpoint step to export; default: the newest.")
  flags.DEFINE_enum("dtype", "float32", sorted(hf_checkpoint.EXPORT_DTYPES), "The stored weights' dtype.")
  flags.DEFINE_bool("adapter", False, "Write a LoRA run's adapters as a PEFT adapter directory.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  args = flags.FLAGS
  logging.set_verbosity(logging.WARNING)  # keep orbax's restore chatter off the console
  try:
    print(export(args.workdir, args.output, args.step, args.dtype, args.adapter))
  except ValueError as error:
    sys.exit(f"export.py: {error}")  # one line on stderr, exit status 1


if __name__ == "__main__":
  define_flags()
  app.run(main)
