"""Throughput of the real train step beside the peers: tokens/s, MFU, step time, peak memory, compile time.

  python tools/bench.py --config=configs/gpt2.py:124m --batch=32 --config.model.attention=cudnn --peers=.peers
  python tools/bench.py --config=configs/gpt2.py:124m --config=configs/gpt2.py:1558m --batch=16 --best_batch
  python tools/bench.py --config=configs/gpt2.py:tiny --config=configs/gpt2.py:tiny,model.num_layers=4 --seq_len=128
  python tools/bench.py --layouts=cpu               # tiny models on 8 simulated CPU devices, every layout
  python tools/bench.py --report=bench.jsonl        # the tables again, from saved records

Every measurement runs in its own process, so each has its own XLA flags
(`--xla_presets`), its own peak-memory count and a clean device when an
earlier batch ran out of memory. Each prints one JSON line; the tables follow.
`--config` may repeat, each `FILE:VARIANT` optionally followed by
`,field=value` overrides of its own; `--config.<field>=<value>` applies to all.
Ratios compare tokens/s with the first config's at the same batch and preset,
and with each peer at the same shape, sequence and batch; a config no peer
matches (meshlm's byte-level tiny, say) gets the reason instead of a ratio.
"""

import json
import os
import sys
import time

from absl import app, flags

from measure import bench_report, peers
from measure.bench_runs import (
    CPU_LAYOUTS, XLA_PRESETS, batch_sizes, build_config, check_presets, child_env, measure_here, run_child,
    searched, split_overrides)

_CONFIGS = flags.DEFINE_multi_string("config", ["configs/gpt2.py:124m"],
                                     "FILE:VARIANT[,field=value...]; repeat to compare configs.")
_BATCH = flags.DEFINE_list("batch", [], "Global batch sizes; empty: each config's batch_size.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Sequence length (model.max_len); default 1024, 128 for --layouts.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per window.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps after compiling.", lower_bound=0)
_WINDOWS = flags.DEFINE_integer("windows", 3, "Timed windows; the step time is the median window's.", lower_bound=1)
_BEST = flags.DEFINE_bool("best_batch", False, "Double the first batch until it no longer fits (or --max_batch).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 1024, "Largest batch --best_batch tries.", lower_bound=1)
_PRESETS = flags.DEFINE_list("xla_presets", ["default"], f"XLA flag presets to run: {', '.join(XLA_PRESETS)}.")
_PEERS = flags.DEFINE_string("peers", "", "Folder holding torch_gpt2.py and jax_gpt2.py, run beside each GPT-2 size.")
_TIMEOUT = flags.DEFINE_integer("timeout", 900, "Seconds one measurement (ours or a peer's) may take.", lower_bound=1)
_LAYOUTS = flags.DEFINE_enum("layouts", None, ["cpu"], "Every parallel layout of the tiny models on simulated CPUs.")
_OUT = flags.DEFINE_string("out", "", "Also append the JSON lines to this file.")
_REPORT = flags.DEFINE_string("report", "", "Print the tables from this file of JSON lines, and run nothing.")
_RUN_ONE = flags.DEFINE_string("run_one", "", "Internal: one measurement, as JSON, in this process.")


class Bench:
  """Runs measurements one after another, printing each record as it lands."""

  def __init__(self, out: str):
    self.records, self._out = [], out

  def add(self, record: dict) -> dict:
    self.records.append(record)
    line = json.dumps(record)
    print(line, flush=True)
    if self._out:
      with open(self._out, "a") as f:
        f.write(line + "\n")
    return record

  def ours(self, run: dict, env: dict) -> dict:
    print(f"[bench] {run.get('layout') or run['config']} batch {run['batch']} preset {run['preset']}",
          file=sys.stderr, flush=True)
    return self.add({"kind": "meshlm", **run_child(run, env, _TIMEOUT.value)})

  def peer(self, name: str, size: str, batch: int) -> dict:
    print(f"[bench] peer {name} {size}:{batch}", file=sys.stderr, flush=True)
    return self.add({"kind": "peer", **peers.run_peer(_PEERS.value, name, size, batch,
                                                      timeout_s=_TIMEOUT.value, env=child_env("default"))})


def peer_fields(model) -> dict:
  """The records' peer size; with --peers and no peer of this shape, also why, which the tables print."""
  size = peers.peer_size(model)
  return {"peer_size": size, **({"no_peer": peers.why_no_peer(model)} if _PEERS.value and not size else {})}


def run_configs(bench: Bench, overrides: list[tuple[str, str]]) -> None:
  seq_len = _SEQ_LEN.value or 1024
  plans = []
  for spec in _CONFIGS.value:  # every config is checked before anything runs
    config = build_config(spec, overrides, batch=None, seq_len=seq_len)
    batches = [int(b) for b in _BATCH.value] or [config.batch_size]
    plans.append((spec, peer_fields(config.model), batches))
  timing = {"steps": _STEPS.value, "warmup": _WARMUP.value, "windows": _WINDOWS.value}
  for preset in _PRESETS.value:
    for spec, peer, batches in plans:
      run = {"config": spec, "overrides": overrides, "seq": seq_len, "preset": preset, **peer, **timing}
      for first in batches:
        searched(lambda b, run=run: bench.ours({**run, "batch": b}, child_env(run["preset"])),
                 batch_sizes(first, _BEST.value, _MAX_BATCH.value))
  if not _PEERS.value:
    return
  # Each peer once per GPT-2 size and first batch, however many configs or presets share them.
  sizes = {(peer["peer_size"], first) for _, peer, batches in plans if peer["peer_size"] for first in batches}
  for size, first in sorted(sizes):
    for name in peers.SCRIPTS:
      searched(lambda b, name=name, size=size: bench.peer(name, size, b),
               batch_sizes(first, _BEST.value, _MAX_BATCH.value))


def run_layouts(bench: Bench, overrides: list[tuple[str, str]]) -> None:
  seq_len = _SEQ_LEN.value or 128
  batch = int(_BATCH.value[0]) if _BATCH.value else 32
  timing = {"steps": _STEPS.value, "warmup": _WARMUP.value, "windows": _WINDOWS.value}
  for group, name, spec, layout, devices in CPU_LAYOUTS:
    own = overrides + [(path, str(value)) for path, value in layout.items()]
    build_config(spec, own, batch=batch, seq_len=seq_len)  # a typo stops here, not in a child
    bench.ours({"config": spec, "overrides": own, "batch": batch, "seq": seq_len, "preset": _PRESETS.value[0],
                "group": group, "layout": name, **timing}, child_env(_PRESETS.value[0], devices))


def main(argv):
  overrides = argv[1]
  if _RUN_ONE.value:
    print(json.dumps(measure_here(json.loads(_RUN_ONE.value))), flush=True)
    return
  if _REPORT.value:
    print(bench_report.tables(bench_report.read_records(_REPORT.value)))
    return
  if not all(b.isdigit() and int(b) > 0 for b in _BATCH.value):
    raise ValueError(f"--batch={','.join(_BATCH.value)} must be positive integers, e.g. --batch=16,32.")
  check_presets(_PRESETS.value)
  if _PEERS.value and not os.path.isdir(_PEERS.value):
    raise ValueError(f"--peers={_PEERS.value} is not a folder; copy ../shared/peers there first.")
  bench = Bench(_OUT.value)
  started = time.perf_counter()
  (run_layouts if _LAYOUTS.value else run_configs)(bench, overrides)
  print(f"\n<!-- {len(bench.records)} measurements in {time.perf_counter() - started:.0f} s -->")
  print(bench_report.tables(bench.records))


def _parse_flags(argv):
  """absl parses the flags; `--config.*` overrides are handed to main as argv[1]."""
  try:
    rest, overrides = split_overrides(argv)
    program, *unparsed = flags.FLAGS(rest)
  except (ValueError, flags.Error) as error:
    sys.exit(f"error: {error}")
  if unparsed:
    sys.exit(f"error: unexpected arguments {unparsed}; every option is --name=value.")
  return [program, overrides]


def _main_with_errors(argv):
  try:
    main(argv)
  except ValueError as error:
    sys.exit(f"error: {error}")


if __name__ == "__main__":
  app.run(_main_with_errors, flags_parser=_parse_flags)
