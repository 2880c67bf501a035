"""Throughput and model-FLOPs utilisation, and where logged metrics go (console, JSONL, TensorBoard)."""

import json
import math
import os
import subprocess
import uuid

import jax
from model.config import ModelConfig

# Dense bf16 peak per device, in TFLOP/s, from the vendors' data sheets.
PEAK_TFLOPS = {
    "h200": 989.0, "h100": 989.0, "a100": 312.0, "l4": 121.0,
    "tpu v4": 275.0, "tpu v5 lite": 197.0, "tpu v5e": 197.0, "tpu v5p": 459.0, "tpu v6 lite": 918.0,
    "tpu v6e": 918.0,
}


def flops_per_token(cfg: ModelConfig, param_count: int) -> float:
  """Training FLOPs per token: 6N for the matmuls plus 12*L*T*d for attention (PaLM, appendix B)."""
  return 6 * param_count + 12 * cfg.num_layers * cfg.max_len * cfg.embed_dim


def peak_flops_per_device(override_tflops: float) -> float | None:
  """The device's peak in FLOP/s, or None when unknown (a CPU): MFU is then not reported."""
  if override_tflops > 0:
    return override_tflops * 1e12
  kind = jax.devices()[0].device_kind.lower()
  for name, tflops in PEAK_TFLOPS.items():
    if name in kind:
      return tflops * 1e12
  return None


def mfu(tokens_per_sec: float, flops_token: float, peak_per_device: float | None) -> float | None:
  if peak_per_device is None:
    return None
  return tokens_per_sec * flops_token / (peak_per_device * jax.device_count())


class MetricsWriter:
  """One JSON object per logged step in <workdir>/metrics.jsonl, TensorBoard scalars, and W&B when configured.

  Only process 0 writes, so a multi-host run leaves one copy.
  """

  def __init__(self, workdir: str, after_step: int = 0, config=None):
    self.active = jax.process_index() == 0
    self._wandb = None
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    self._path = os.path.join(workdir, "metrics.jsonl")
    _drop_records_after(self._path, after_step)  # a fresh start (0) too: a crash may predate any checkpoint
    self._jsonl = open(self._path, "a")
    from tensorboardX import SummaryWriter  # imported here: only the writing process needs it
    self._tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))
    if config is not None and config.wandb.project:
      self._wandb = _wandb_run(workdir, config)

  def write(self, step: int, metrics: dict) -> None:
    if not self.active:
      return
    # Strict JSON has no NaN or Infinity: a non-finite figure is written as null.
    strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
    self._jsonl.write(json.dumps({"step": step, **strict}, allow_nan=False) + "\n")
    self._jsonl.flush()
    scalars = {key: value for key, value in metrics.items() if value is not None}
    for key, value in scalars.items():
      self._tensorboard.add_scalar(key, value, step)
    if self._wandb is not None:
      self._wandb.log(scalars, step=step)

  def rewind(self, step: int) -> None:
    """Drops the losses and evaluations after `step`, which a run rolled back to it (a peer copy)
    computes again; what befell its processes meanwhile stays, as it happened. TensorBoard keeps
    both; W&B ignores steps below its last, as it does for a resumed run."""
    if not self.active:
      return
    self._jsonl.close()
    _drop_records_after(self._path, step, redone=lambda record: "loss" in record or "eval_loss" in record)
    self._jsonl = open(self._path, "a")

  def close(self) -> None:
    if self.active:
      self._jsonl.close()
      self._tensorboard.close()
      if self._wandb is not None:
        self._wandb.finish()

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *exc_info):
    try:
      self.close()
    except OSError:
      # A full disk that failed the run's checkpoint fails this last flush too; the run's own
      # error, already on its way out, is the one that says what happened.
      if exc_type is None:
        raise


def _drop_records_after(path: str, step: int, redone=lambda record: True) -> None:
  """A resumed run recomputes the steps after its checkpoint; their old records (those `redone`
  picks) give way.

  A torn last line (a crash mid-write) is dropped; a damaged line elsewhere is refused by number.
  """
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.read().splitlines()
  kept = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if number == len(lines):
        break
      raise ValueError(f"{path} line {number} is not JSON ({line[:40]!r}); repair or delete that "
                       "line, then run again.") from None
    if record["step"] <= step or not redone(record):
      kept.append(line + "\n")
  with open(path + ".tmp", "w") as f:
    f.writelines(kept)
  os.replace(path + ".tmp", path)


def _wandb_run(workdir: str, config):
  """A W&B run for `workdir`: its id is kept there, so a resumed run continues the same W&B run."""
  import wandb  # optional dependency (pyproject's `wandb` extra); validate.py checks it is there
  id_file = os.path.join(workdir, "wandb_id")
  run_id = open(id_file).read().strip() if os.path.exists(id_file) else uuid.uuid4().hex[:12]
  with open(id_file, "w") as f:
    f.write(run_id + "\n")
  return wandb.init(project=config.wandb.project, group=config.wandb.group or None, id=run_id, resume="allow",
                    name=os.path.basename(os.path.abspath(workdir)), dir=workdir,
                    config={"git_commit": git_commit(), **config.to_dict()})


def git_commit() -> str:
  """The checkout's commit (with `+changes` when files differ from it), or "unknown" outside git."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                            check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return commit + ("+changes" if dirty else "")
