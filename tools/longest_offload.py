"""The longest context the memory estimator fits on this device under `model.remat=full_offload`, compiled there.

  python tools/longest_offload.py                          # on a GPU: the 1B Llama in the card's memory
  python tools/longest_offload.py --spec=configs/llama.py:tiny,model.remat=full_offload --limit_gb=0.1

tools/longest_context.py's search (one sequence, one device) at the memory
jax gives this device (`bytes_limit`, which XLA_PYTHON_CLIENT_MEM_FRACTION
sets) or --limit_gb, then the step compiled ahead of time at that length,
allocating nothing: XLA's peak beside the estimate and the limit, and the
host bytes the offload needs beside the estimate's. longest_context.py's own
--compile leaves offloading out, since off an accelerator the host memory is
the device memory; here the device is the accelerator. No step runs: at the
1B Llama's half-million tokens one step is minutes of attention. Prints one
JSON line (kind long_context).
"""

import json
import os
import sys
import time

# Compiled, never run, as in tools/longest_context.py: XLA's pass that widens bf16 all-reduces to float32 is skipped.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=all-reduce-promotion"

import jax  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position

from measure import analysis, estimate  # pylint: disable=wrong-import-position
from measure.bench_runs import build_config  # pylint: disable=wrong-import-position
from measure.dry_run import model_weights  # pylint: disable=wrong-import-position
from measure.longest_context import longest, sequence_mesh  # pylint: disable=wrong-import-position
from training.state import plan  # pylint: disable=wrong-import-position
from training.step import compile_train_step  # pylint: disable=wrong-import-position

_SPEC = flags.DEFINE_string("spec", "configs/llama.py:1b,model.remat=full_offload",
                            "FILE:VARIANT[,field=value...], as tools/bench.py's --config.")
_LIMIT_GB = flags.DEFINE_float("limit_gb", 0.0, "Device memory in GB (1e9 bytes); 0: what jax gives this device.",
                               lower_bound=0.0)
_OUT = flags.DEFINE_string("out", "", "Also append the JSON line to this file (as tools/bench.py's --out).")
GB = 1e9


def device_limit(device) -> int:
  """--limit_gb in bytes, else the memory jax lets this device use."""
  if _LIMIT_GB.value:
    return int(_LIMIT_GB.value * GB)
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if not limit:
    raise ValueError(f"this {device.platform} device reports no memory limit; pass --limit_gb=GB.")
  return limit


def main(argv):
  del argv
  device = jax.devices()[0]
  limit = device_limit(device)
  config = build_config(_SPEC.value, [], batch=1, seq_len=1024)
  config.grad_accum = 1
  weights = model_weights(config)
  length = longest(config, 1, limit, weights)
  if not length:
    raise ValueError(f"not even 1,024 tokens of {_SPEC.value} fit {limit / GB:.2f} GB by the estimate; "
                     "raise --limit_gb or pick a smaller model.")
  config.model.max_len = length
  guess = sum(estimate.memory(config, sequence_mesh(1), weights).values())
  started = time.perf_counter()
  compiled = compile_train_step(plan(config, [device]), config)
  compile_s = time.perf_counter() - started
  host = getattr(compiled.memory_analysis(), "host_temp_size_in_bytes", 0) or 0
  line = json.dumps({
      "kind": "long_context", "spec": _SPEC.value, "device_kind": device.device_kind, "length": length,
      "limit_gb": round(limit / GB, 2), "estimate_gb": round(guess / GB, 2),
      "compiled_gb": round(analysis.memory_summary(compiled)["peak_bytes"] / GB, 2),
      "host_estimate_gb": round(estimate.host_memory(config, sequence_mesh(1)) / GB, 2),
      "compiled_host_gb": round(host / GB, 2), "compile_s": round(compile_s, 1)})
  print(line, flush=True)
  if _OUT.value:
    with open(_OUT.value, "a") as f:
      f.write(line + "\n")


def _main_with_errors(argv):
  try:
    main(argv)
  except ValueError as error:
    sys.exit(f"error: {error}")


if __name__ == "__main__":
  app.run(_main_with_errors)
