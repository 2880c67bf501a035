"""One throughput measurement of the real train step: compile time, step time, tokens/s, MFU, peak memory.

The step is the one train.py runs (`make_train_step` on a `plan` layout, state
donated), compiled ahead of time so that compiling is timed apart from running,
and fed one synthetic batch over and over: what is measured is the step, not
the data pipeline.
"""

import math
import statistics
import time

import jax

from input_pipeline import data
from measure import analysis
from measure.profiling import StepProfiler, parse_steps
from training import metrics
from training.in_flight import StepsInFlight
from training.state import active_param_count, init_state, param_count, plan
from training.step import compile_train_step

GIB = 2**30


def measure(config, *, warmup: int, steps: int, windows: int) -> dict:
  """Time `windows` windows of `steps` steps each, after `warmup` steps; the step time is the median window's.

  The device is waited on only at the end of a window, as the training loop
  waits only at log steps, so host dispatch overlaps device work as it does
  in training.
  """
  if warmup < 0 or steps < 1 or windows < 1:
    raise ValueError(f"need warmup >= 0, steps >= 1 and windows >= 1, got {warmup}, {steps}, {windows}.")
  layout = plan(config)
  started = time.perf_counter()
  compiled = compile_train_step(layout, config)
  compile_s = time.perf_counter() - started
  compiled_peak = analysis.memory_summary(compiled)["peak_bytes"]
  params = param_count(layout)
  seq_len = layout.model.max_len
  record = {"params": params, "active_params": active_param_count(layout), "batch": config.batch_size, "seq": seq_len,
            "mesh": {axis: size for axis, size in layout.mesh.shape.items() if size > 1},
            "devices": layout.mesh.size, "device_kind": jax.devices()[0].device_kind,
            "compute": config.precision.compute, "attention": layout.model.attention,
            "remat": config.model.remat, "compile_s": round(compile_s, 2),
            "compiled_peak_gib": round(compiled_peak / GIB, 3)}
  limit = _device_bytes_limit()
  if limit and compiled_peak > limit:
    return {**record, "fits": False,
            "error": f"needs {compiled_peak / GIB:.1f} GiB per device, the device holds {limit / GIB:.1f} GiB"}

  state = init_state(layout, config.seed)
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=data.data_seed(config), step=0, batch_size=config.batch_size,
                            seq_len=seq_len, sharding=layout.batch_sharding)
  in_flight = StepsInFlight()
  for _ in range(warmup):
    state, step_metrics = compiled(state, batch)
    in_flight.add(step_metrics["loss"])
  jax.block_until_ready(state)
  window_s = []
  for _ in range(windows):
    started, in_flight = time.perf_counter(), StepsInFlight()
    for _ in range(steps):
      state, step_metrics = compiled(state, batch)
      in_flight.add(step_metrics["loss"])
    jax.block_until_ready((state, step_metrics))
    window_s.append((time.perf_counter() - started) / steps)
  _profile(config, compiled, state, batch)

  step_s = statistics.median(window_s)
  tokens_per_s = config.batch_size * seq_len / step_s
  mfu = metrics.mfu(tokens_per_s, metrics.flops_per_token(layout.model, record["active_params"]),
                    metrics.peak_flops_per_device(config.peak_tflops))
  device_peak = _device_peak_bytes()
  loss = float(step_metrics["loss"])
  return {**record, "fits": True, "step_s": round(step_s, 5),
          "window_step_s": [round(s, 5) for s in window_s], "tokens_per_s": round(tokens_per_s, 1),
          "mfu": None if mfu is None else float(f"{mfu:.4g}"),
          "peak_mem_gib": round((device_peak or compiled_peak) / GIB, 3),
          "peak_mem_source": "device.memory_stats" if device_peak else "compiled.memory_analysis",
          "loss": loss if math.isfinite(loss) else None}


def _profile(config, compiled, state, batch) -> None:
  """With `profile_steps` FIRST,LAST: one more window of LAST - FIRST + 1 steps, traced into <workdir>/profile
  (runs/bench/profile where the spec names no workdir: a measurement writes nothing else)."""
  window = parse_steps(config.profile_steps, config.steps)
  if window is None:
    return
  first, last = window
  with StepProfiler(window, config.workdir or "runs/bench") as profiler:
    for step in range(first, last + 1):
      profiler.before(step)
      with profiler.annotate(step):
        state, _ = compiled(state, batch)
      profiler.after(step, state)


def _device_peak_bytes() -> int | None:
  """The process's peak allocation on its busiest device, where the backend counts it (GPU, TPU)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  return max(peaks) if all(peaks) else None


def _device_bytes_limit() -> int | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")
