"""Throughput and model-FLOPs utilisation, and where logged metrics go (console, JSONL, TensorBoard)."""

import json
import math
import os

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
  """One JSON object per logged step in <workdir>/metrics.jsonl, and TensorBoard scalars.

  Only process 0 writes, so a multi-host run leaves one copy.
  """

  def __init__(self, workdir: str, after_step: int = 0):
    self.active = jax.process_index() == 0
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    _drop_records_after(path, after_step)  # a fresh start (0) too: a crash may predate any checkpoint
    self._jsonl = open(path, "a")
    from tensorboardX import SummaryWriter  # imported here: only the writing process needs it
    self._tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict) -> None:
    if not self.active:
      return
    # Strict JSON has no NaN or Infinity: a non-finite figure is written as null.
    strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
    self._jsonl.write(json.dumps({"step": step, **strict}, allow_nan=False) + "\n")
    self._jsonl.flush()
    for key, value in metrics.items():
      if value is not None:
        self._tensorboard.add_scalar(key, value, step)

  def close(self) -> None:
    if self.active:
      self._jsonl.close()
      self._tensorboard.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def _drop_records_after(path: str, step: int) -> None:
  """A resumed run recomputes the steps after its checkpoint; their old records give way.

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
    if record["step"] <= step:
      kept.append(line + "\n")
  with open(path + ".tmp", "w") as f:
    f.writelines(kept)
  os.replace(path + ".tmp", path)
