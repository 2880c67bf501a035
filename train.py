"""Train a language model on the devices present.

  python train.py                                   # tiny GPT-2 on the built-in corpus
  python train.py --config=configs/gpt2.py:124m --config.mesh.tensor=2 --config.workdir=runs/a
  python train.py --config.mesh.data=4 --config.mesh.tensor=2 --dry_run
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "gpt2.py:tiny"),
    "A config file and variant, e.g. configs/gpt2.py:124m; fields by --config.<field>=<value>.",
    lock_config=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the step and report memory and collectives; no training.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep jax's backend chatter off the console
  from training.loop import train  # after flag parsing: importing jax earlier would fix its flags too soon
  try:
    train(_CONFIG.value, dry_run=_DRY_RUN.value)
  except ValueError as error:
    # Configuration mistakes are raised as one-sentence ValueErrors before anything compiles.
    sys.exit(f"error: {error}")


if __name__ == "__main__":
  app.run(main)
