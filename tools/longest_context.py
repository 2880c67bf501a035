"""The longest context that fits: the textbook's long-context table, from meshlm's memory estimator.

  python tools/longest_context.py                      # 1B Llama, bf16, 80 and 141 GB, 1 / 8 / 32 devices
  python tools/longest_context.py --memory_gb=80 --devices=8 --remat=full,none --mlp_chunk=0,1024
  python tools/longest_context.py --write               # and rewrite docs/long_context.md's <!-- longest-context -->
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/longest_context.py --compile --memory_gb=80

For each device memory, device count (all of them on `sequence`, one
sequence in the batch), context strategy and remat policy, the longest
sequence whose estimated per-device bytes (measure/estimate.py: parameters,
gradients, AdamW moments, activations) fit. Attention is blockwise and the
loss chunked, so activations grow linearly in T / devices. Nothing is
compiled, unless --compile: then each `full` remat cell whose devices this
machine has (simulated ones count) is compiled ahead of time at the length
the table gives, allocating nothing, and XLA's per-device peak is printed
beside the estimate's and the memory size. Offloading policies are left
out there: off an accelerator the host memory is the device memory.
"""

import math
import os
from pathlib import Path

# This tool compiles and never runs: skip XLA's CPU pass that widens bf16 all-reduces to float32, which
# aborts on the sequence-sharded 1B step (train.py --dry_run --simulate_devices does the same).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=all-reduce-promotion"

import jax  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections import config_flags  # pylint: disable=wrong-import-position

from measure import analysis, estimate  # pylint: disable=wrong-import-position
from measure.doc_blocks import replace_block  # pylint: disable=wrong-import-position
from measure.dry_run import model_weights  # pylint: disable=wrong-import-position
from measure.longest_context import longest, sequence_mesh  # pylint: disable=wrong-import-position
from parallel.context import STRATEGIES  # pylint: disable=wrong-import-position
from training.state import plan  # pylint: disable=wrong-import-position
from training.step import compile_train_step  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", "configs/llama.py:1b", "Model and run config.")
_MEMORY = flags.DEFINE_list("memory_gb", ["80", "141"], "Device memory sizes in GB (1e9 bytes).")
_DEVICES = flags.DEFINE_list("devices", ["1", "8", "32"], "Device counts, all on the `sequence` axis.")
_REMAT = flags.DEFINE_list("remat", ["full", "full_offload"], "model.remat policies.")
_MLP_CHUNK = flags.DEFINE_list("mlp_chunk", ["0", "4096"], "model.mlp_chunk values (tokens per device; 0: off).")
_COMPILE = flags.DEFINE_bool("compile", False, "Compile the `full` remat cells at their lengths and print XLA's peak.")
_WRITE = flags.DEFINE_bool("write", False, "Rewrite the table between <!-- longest-context --> markers in PAGE.")
PAGE = Path(__file__).resolve().parent.parent / "docs" / "long_context.md"  # the page that holds the table


def usable(config, strategy: str, devices: int) -> bool:
  """Ulysses splits the key/value heads over the devices; the other strategies take any count."""
  return strategy != "ulysses" or (config.model.kv_heads or config.model.num_heads) % devices == 0


def cell(config, devices: int, memory_bytes: int, weights) -> str:
  """The longest length, and the host memory per device an offloading remat policy needs at it."""
  length = longest(config, devices, memory_bytes, weights)
  config.model.max_len = length
  host = estimate.host_memory(config, sequence_mesh(devices))
  return f"{length:,}" + (f" ({host / 1e9:.0f} GB host)" if host else "")


def rows(config, remats):
  """Each (memory GB, strategy, remat, mlp_chunk) of the table in order, set on `config` as it is yielded."""
  for memory_gb in map(float, _MEMORY.value):
    for strategy in STRATEGIES:
      for remat in remats:
        for mlp_chunk in map(int, _MLP_CHUNK.value):
          config.attention.context, config.model.remat, config.model.mlp_chunk = strategy, remat, mlp_chunk
          yield memory_gb, strategy, remat, mlp_chunk


def table(config) -> str:
  config.batch_size, config.grad_accum = 1, 1
  weights = model_weights(config)  # the parameters do not depend on the length (rotary positions)
  devices = [int(d) for d in _DEVICES.value]
  lines = [f"Longest context in tokens, {config.model.family} with {sum(math.prod(w.shape) for w in weights) / 1e9:.2f}B "
           f"parameters, {config.precision.compute}, one sequence, attention_block={config.model.attention_block}, "
           f"loss_chunk={config.model.loss_chunk}:", "",
           "| memory per device | strategy | remat | mlp_chunk | "
           + " | ".join(f"{d} device{'s' * (d > 1)}" for d in devices) + " |",
           "|---" * (4 + len(devices)) + "|"]
  for memory_gb, strategy, remat, mlp_chunk in rows(config, _REMAT.value):
    cells = [cell(config, d, int(memory_gb * 1e9), weights) if usable(config, strategy, d)
             else "n/a" for d in devices]
    lines.append(f"| {memory_gb:g} GB | {strategy} | {remat} | {mlp_chunk or 'off'} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def print_compiled_peaks(config) -> None:
  """Each `full` remat cell compiled at its longest length: estimated and XLA's peak bytes per device,
  printed row by row (each compile takes a while)."""
  config.batch_size, config.grad_accum, config.data.source = 1, 1, "synthetic"
  weights = model_weights(config)
  print("| memory per device | strategy | mlp_chunk | devices | length | estimate GB | compiled GB | compiled / estimate |")
  print("|---" * 8 + "|", flush=True)
  for memory_gb, strategy, _, mlp_chunk in rows(config, ["full"]):
    for devices in (int(d) for d in _DEVICES.value):
      if devices > jax.device_count() or not usable(config, strategy, devices):
        continue
      config.model.max_len = longest(config, devices, int(memory_gb * 1e9), weights)
      config.mesh.data, config.mesh.sequence = 1, devices
      guess = sum(estimate.memory(config, sequence_mesh(devices), weights).values())
      layout = plan(config, jax.devices()[:devices])
      peak = analysis.memory_summary(compile_train_step(layout, config))["peak_bytes"]
      print(f"| {memory_gb:g} GB | {strategy} | {mlp_chunk or 'off'} | {devices} | {config.model.max_len:,} | "
            f"{guess / 1e9:.1f} | {peak / 1e9:.1f} | {peak / guess:.2f} |", flush=True)


def main(argv):
  del argv
  if _COMPILE.value:
    print_compiled_peaks(_CONFIG.value)
    return
  text = table(_CONFIG.value)
  print(text, end="")
  if _WRITE.value:
    made_by = "\nMade by `python tools/longest_context.py --write` (n/a: Ulysses needs the 8 key/value heads to divide over the devices).\n"
    PAGE.write_text(replace_block(PAGE.read_text(), "longest-context", text + made_by))


if __name__ == "__main__":
  app.run(main)
