"""Where a run writes when its command names no --config.workdir: a folder named from the command, so
the same command resumes the same run and any other command starts a run of its own."""

import hashlib
import os
from pathlib import Path

DEFAULT_CONFIG = "configs/gpt2.py:tiny"  # train.py's --config when none is given
ROOT = Path(__file__).resolve().parent.parent  # train.py's folder, where tools/launch.py starts its processes

# Fields that change how a run is watched, saved or spread over processes, not what it trains: the same
# run resumed with another cadence of logs or saves, under survive mode, or on every process of a
# multi-host launch (each with its own distributed.process_id) keeps its place.
_BOOKKEEPING = ("workdir", "resume", "log_every", "eval_every", "eval_batches", "sample_tokens", "sample_prompt",
                "peak_tflops", "profile_steps", "wandb.", "checkpoint.", "distributed.", "fault_tolerance",
                "peer_copy_every", "data.prefetch")


def default_workdir(argv: list[str]) -> str:
  """runs/<config file>-<variant>, and where the command overrides what the run trains, a digest of those
  overrides: runs/gpt2-tiny, runs/gpt2-moe_tiny-1c0ffee5. `argv` is the command's flags."""
  config, overrides = _config_flags(argv)
  file, _, variant = config.partition(":")
  name = "-".join(part for part in (Path(file).stem, variant) if part)
  defining = sorted(f"{field}={value}" for field, value in overrides.items() if not field.startswith(_BOOKKEEPING))
  if defining:
    name += "-" + hashlib.sha256("\n".join(defining).encode()).hexdigest()[:8]
  return os.path.join("runs", name)


def workdir_of(command: list[str]) -> Path:
  """The workdir train.py (`command[0]`) writes to, run from the repository's root as launched processes are."""
  given = [arg.split("=", 1)[1] for arg in command if arg.startswith("--config.workdir=")]
  return (ROOT / (given[-1] if given else default_workdir(command[1:]))).resolve()


def _config_flags(argv: list[str]) -> tuple[str, dict[str, str]]:
  """(the --config file and variant, {field: value} of the --config.<field> overrides, the last of each),
  as absl reads them: `--flag=value`, `--flag value`, or a bare boolean `--flag`."""
  config, overrides = DEFAULT_CONFIG, {}
  at = 0
  while at < len(argv):
    name, equals, value = argv[at].lstrip("-").partition("=")
    at += 1
    if not argv[at - 1].startswith("--config") or name.split(".")[0] != "config":
      continue
    if not equals:
      takes_next = at < len(argv) and not argv[at].startswith("--")
      value, at = (argv[at], at + 1) if takes_next else ("true", at)
    if name == "config":
      config = value
    else:
      overrides[name.removeprefix("config.")] = value
  return config, overrides
