"""Train a language model on the devices present.

  python train.py                                   # tiny GPT-2 on the built-in corpus
  python train.py --config=configs/gpt2.py:124m --config.mesh.tensor=2 --config.workdir=runs/a
  python train.py --config.mesh.data=4 --config.mesh.tensor=2 --dry_run
  python train.py --config=configs/gpt2.py:1558m --dry_run --simulate_devices=64 --config.mesh.pipeline=4
"""

import os
import sys

from absl import app, flags, logging

from run.config_flag import define_config_flag


_CONFIG = define_config_flag(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "gpt2.py:tiny"),
    "A config file and variant, e.g. configs/gpt2.py:124m; fields by --config.<field>=<value>.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the step and report memory and collectives; no training.")
_SIMULATE_DEVICES = flags.DEFINE_integer(
    "simulate_devices", 0, "Run on this many simulated CPU devices (0: the real ones); with --dry_run, "
    "plans a cluster of that size from one machine.", lower_bound=0)


def _simulate(devices: int, dry_run: bool) -> None:
  """Make jax see `devices` CPU devices; only works before jax is first imported."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  extra = [f"--xla_force_host_platform_device_count={devices}"]
  if dry_run:
    # XLA's CPU-only pass that widens bf16 all-reduces to float32 aborts on the
    # pipeline's bf16 psums; a program that is only compiled, never run, can skip it.
    extra.append("--xla_disable_hlo_passes=all-reduce-promotion")
  os.environ["XLA_FLAGS"] = " ".join(
      [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
      + extra)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep jax's backend chatter off the console
  if _SIMULATE_DEVICES.value:
    _simulate(_SIMULATE_DEVICES.value, _DRY_RUN.value)
  from run.loop import train  # after flag parsing: importing jax earlier would fix its flags too soon
  from run.run_name import default_workdir
  config_file = flags.FLAGS["config"].config_filename.split(":")[0]
  if not os.path.isfile(config_file):
    sys.exit(f"error: the config file {config_file!r} does not exist; give one like configs/gpt2.py:tiny.")
  config = _CONFIG.value
  if not config.workdir:  # the command names the run's place: the same command resumes it
    config.workdir = default_workdir(sys.argv[1:])
  try:
    train(config, dry_run=_DRY_RUN.value)
  except ValueError as error:
    # Configuration mistakes are raised as one-sentence ValueErrors before anything compiles.
    sys.exit(f"error: {error}")


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    # A config file that refuses its variant raises inside absl's parser, which
    # prints the whole traceback; the last line holds the sentence that matters.
    message = str(error).strip().splitlines()[-1].split("Error: ", 1)[-1]
    if "before a value for --config was specified" in message:
      message += ": give --config=FILE first, then the --config.<field>=<value> overrides that apply to it"
    sys.exit(f"error: {message}")
  except SyntaxError as error:
    # Python's own message points into the file; the loader's frames around it say nothing more.
    sys.exit(f"error: the config file {error.filename!r} has a syntax error at line {error.lineno} "
             f"({error.msg}); fix it, or give another such as configs/gpt2.py:tiny.")
  except OSError:
    # With overrides present the parser loads the file itself; a missing one raised two chained tracebacks.
    named = [arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith("--config=")]
    sys.exit(f"error: the config file {named[-1] if named else ''!r} cannot be loaded; give one like "
             "configs/gpt2.py:tiny.")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
