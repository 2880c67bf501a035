"""Per-device memory of the compiled train step against context length and `sequence` degree.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/context_memory.py --lengths 1024,2048,4096,8192

Compiles ahead of time on simulated devices, allocating nothing, with the
`long` Llama variant (or --config), one sequence per data-parallel group, and
prints XLA's temporary (activation) bytes per device: sharding the sequence
over S devices divides them by about S. With --estimate each cell also shows
measure/estimate.py's figure for the same run, compiled / estimate.
"""

import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from measure import analysis, estimate
from measure.dry_run import model_weights
from training.state import plan
from training.step import compile_train_step

_CONFIG = config_flags.DEFINE_config_file("config", "configs/llama.py:long", "Model and run config.")
_LENGTHS = flags.DEFINE_list("lengths", ["1024", "2048", "4096", "8192"], "Context lengths.")
_DEGREES = flags.DEFINE_list("sequence", ["1", "2", "4", "8"], "Sequence-parallel degrees.")
_ESTIMATE = flags.DEFINE_bool("estimate", False, "Show the memory estimate beside each compiled figure.")


def cell(config, length: int, degree: int) -> str:
  """Compiled temporary MiB per device (and, with --estimate, / the estimate's gradients + activations)."""
  config.model.max_len = length
  config.mesh.sequence, config.mesh.data = degree, jax.device_count() // degree
  config.batch_size = config.mesh.data
  layout = plan(config)
  compiled = analysis.memory_summary(compile_train_step(layout, config))["temp_bytes"] / 2**20
  if not _ESTIMATE.value:
    return f"{compiled:14.1f}"
  guess = estimate.memory(config, dict(layout.mesh.shape), model_weights(config))
  return f"{compiled:10.1f} / {(guess['grads'] + guess['activations']) / 2**20:7.1f}"


def main(argv):
  del argv
  config = _CONFIG.value
  degrees = [int(d) for d in _DEGREES.value]
  misfit = next((d for d in degrees if d < 1 or jax.device_count() % d), None)
  if misfit is not None:
    sys.exit(f"error: --sequence degree {misfit} does not divide the {jax.device_count()} devices jax sees; "
             "simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=8 or give smaller degrees.")
  print(f"temporary MiB per device{' (compiled / estimate)' * _ESTIMATE.value}, {config.attention.context} "
        f"attention, remat {config.model.remat}, {jax.device_count()} devices, one sequence per data-parallel group")
  width = 20 if _ESTIMATE.value else 14
  print("  length " + "".join(f"{'sequence=' + str(d):>{width}}" for d in degrees))
  for length in map(int, _LENGTHS.value):
    print(f"{length:8d} " + "".join(cell(config, length, d) for d in degrees))


if __name__ == "__main__":
  app.run(main)
