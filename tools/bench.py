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
and with each peer at the same size and batch.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# `python tools/bench.py` puts tools/ on sys.path, not the repo root.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from absl import app, flags  # pylint: disable=wrong-import-position

from configs import load  # pylint: disable=wrong-import-position
from tools import bench_report, peers  # pylint: disable=wrong-import-position

# Measured one at a time (BENCHMARKS.md keeps what each gained); every flag here
# exists in jaxlib 0.11.2, which refuses unknown ones at start-up.
XLA_PRESETS = {
    "default": [],
    "lhs": ["--xla_gpu_enable_latency_hiding_scheduler=true"],
    "cublas": ["--xla_gpu_enable_triton_gemm=false"],  # cuBLAS(Lt) for every GEMM instead of Triton
    "combined": ["--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_enable_triton_gemm=false",
                 "--xla_gpu_enable_while_loop_double_buffering=true"],  # overlaps the layer scan's iterations
}

GPT, LLAMA = "configs/gpt2.py:tiny", "configs/llama.py:tiny"
# (model, layout, config, overrides, devices). The first of each model is its single-device run. The
# Llama rows give it kv_heads=4 so that Ulysses can split the key/value heads four ways. A layout
# is a row here; MoE rows (mesh.expert over real experts) belong here once that model exists.
CPU_LAYOUTS = [
    ("gpt2 tiny", "single device", GPT, {}, 1),
    ("gpt2 tiny", "data=8", GPT, {"mesh.data": 8}, 8),
    ("gpt2 tiny", "data=4 x tensor=2", GPT, {"mesh.data": 4, "mesh.tensor": 2}, 8),
    ("gpt2 tiny", "data=2 x tensor=4", GPT, {"mesh.data": 2, "mesh.tensor": 4}, 8),
    ("gpt2 tiny", "fsdp (zero=3) data=8", GPT, {"mesh.data": 8, "sharding.zero": 3}, 8),
    ("gpt2 tiny", "zero=1 data=8", GPT, {"mesh.data": 8, "sharding.zero": 1}, 8),
    ("gpt2 tiny", "data=4 x expert=2 (dense: expert acts as data)", GPT, {"mesh.data": 4, "mesh.expert": 2}, 8),
    ("gpt2 tiny", "data=4 x pipeline=2 gpipe", GPT, {"mesh.data": 4, "mesh.pipeline": 2}, 8),
    ("gpt2 tiny", "data=4 x pipeline=2 1f1b", GPT,
     {"mesh.data": 4, "mesh.pipeline": 2, "pipeline.schedule": "1f1b"}, 8),
    ("gpt2 tiny", "data=4 x sequence=2 allgather", GPT, {"mesh.data": 4, "mesh.sequence": 2}, 8),
    ("llama tiny", "single device", LLAMA, {"model.kv_heads": 4}, 1),
    ("llama tiny", "data=2 x sequence=4 allgather", LLAMA,
     {"model.kv_heads": 4, "mesh.data": 2, "mesh.sequence": 4}, 8),
    ("llama tiny", "data=2 x sequence=4 ring", LLAMA,
     {"model.kv_heads": 4, "mesh.data": 2, "mesh.sequence": 4, "attention.context": "ring"}, 8),
    ("llama tiny", "data=2 x sequence=4 ulysses", LLAMA,
     {"model.kv_heads": 4, "mesh.data": 2, "mesh.sequence": 4, "attention.context": "ulysses"}, 8),
]

_CONFIGS = flags.DEFINE_multi_string("config", ["configs/gpt2.py:124m"],
                                     "FILE:VARIANT[,field=value...]; repeat to compare configs.")
_BATCH = flags.DEFINE_list("batch", [], "Global batch sizes; empty: each config's batch_size.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Sequence length (model.max_len); default 1024, 128 for --layouts.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per window.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps after compiling.")
_WINDOWS = flags.DEFINE_integer("windows", 3, "Timed windows; the step time is the median window's.")
_BEST = flags.DEFINE_bool("best_batch", False, "Double the first batch until it no longer fits (or --max_batch).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 1024, "Largest batch --best_batch tries.")
_PRESETS = flags.DEFINE_list("xla_presets", ["default"], f"XLA flag presets to run: {', '.join(XLA_PRESETS)}.")
_PEERS = flags.DEFINE_string("peers", "", "Folder holding torch_gpt2.py and jax_gpt2.py, run beside each GPT-2 size.")
_TIMEOUT = flags.DEFINE_integer("timeout", 900, "Seconds one measurement (ours or a peer's) may take.")
_LAYOUTS = flags.DEFINE_enum("layouts", None, ["cpu"], "Every parallel layout of the tiny models on simulated CPUs.")
_OUT = flags.DEFINE_string("out", "", "Also append the JSON lines to this file.")
_REPORT = flags.DEFINE_string("report", "", "Print the tables from this file of JSON lines, and run nothing.")
_RUN_ONE = flags.DEFINE_string("run_one", "", "Internal: one measurement, as JSON, in this process.")


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """`--config.a.b=v` arguments (for every config) apart from the flags absl parses."""
  rest, overrides = [], []
  for arg in argv:
    if arg.startswith("--config."):
      path, sep, value = arg[len("--config."):].partition("=")
      if not sep:
        raise ValueError(f"{arg} has no value; write --config.{path}=VALUE.")
      overrides.append((path, value))
    else:
      rest.append(arg)
  return rest, overrides


def parse_spec(spec: str) -> tuple[str, list[tuple[str, str]]]:
  """`FILE:VARIANT,a.b=v,...` -> (`FILE:VARIANT`, [(a.b, v), ...])."""
  base, *pairs = spec.split(",")
  overrides = []
  for pair in pairs:
    path, sep, value = pair.partition("=")
    if not sep:
      raise ValueError(f"{pair!r} in --config={spec} is not field=value.")
    overrides.append((path.strip(), value))
  return base, overrides


def build_config(spec: str, overrides: list[tuple[str, str]], *, batch: int | None, seq_len: int):
  """The config a measurement runs: the spec's overrides, then the shared ones, then batch and length."""
  base, own = parse_spec(spec)
  config = load.load(base)
  for path, value in own + overrides:
    load.override(config, path, value)
  config.data.source = "synthetic"  # the step is measured, not the data pipeline
  config.model.max_len = seq_len
  if batch:
    config.batch_size = batch
  return config


def measure_here(run: dict) -> dict:
  """`--run_one`: build the config and measure it in this process; jax is imported only here."""
  import jax  # pylint: disable=import-outside-toplevel
  from training.benchmark import measure  # pylint: disable=import-outside-toplevel
  config = build_config(run["config"], [tuple(o) for o in run["overrides"]], batch=run["batch"],
                        seq_len=run["seq"])
  record = {**run, "batch": config.batch_size, "jax": jax.__version__, "backend": jax.default_backend(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")}
  try:
    return {**record, **measure(config, warmup=run["warmup"], steps=run["steps"], windows=run["windows"])}
  except Exception as error:  # pylint: disable=broad-except
    # Out of memory ends a --best_batch search; anything else is reported in the table, not a traceback.
    return {**record, "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"}


def run_child(run: dict, env: dict) -> dict:
  """One measurement in a fresh process with `env` (its XLA flags and device count)."""
  command = [sys.executable, str(Path(__file__).resolve()), f"--run_one={json.dumps(run)}"]
  try:
    result = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT.value, env=env, cwd=ROOT)
  except subprocess.TimeoutExpired:
    return {**run, "error": f"timed out after {_TIMEOUT.value} s"}
  lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
  if lines:
    return json.loads(lines[-1])
  why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
  return {**run, "error": why[:300]}


def child_env(preset: str, devices: int | None = None) -> dict:
  extra = list(XLA_PRESETS[preset])
  env = dict(os.environ)
  if devices:
    extra.append(f"--xla_force_host_platform_device_count={devices}")
    env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *extra]).strip()
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
  return env


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
    return self.add({"kind": "meshlm", **run_child(run, env)})

  def peer(self, name: str, size: str, batch: int) -> dict:
    print(f"[bench] peer {name} {size}:{batch}", file=sys.stderr, flush=True)
    return self.add({"kind": "peer", **peers.run_peer(_PEERS.value, name, size, batch,
                                                      timeout_s=_TIMEOUT.value, env=child_env("default"))})


def batch_sizes(first: int, best: bool) -> list[int]:
  if not best:
    return [first]
  sizes = [first]
  while sizes[-1] * 2 <= _MAX_BATCH.value:
    sizes.append(sizes[-1] * 2)
  return sizes


def searched(measure_batch, first: int, best: bool) -> list[dict]:
  """Measure `first`, and with `best` keep doubling until a batch fails (out of memory) or passes --max_batch."""
  records = []
  for batch in batch_sizes(first, best):
    records.append(measure_batch(batch))
    if not (records[-1].get("tokens_per_s")):
      break
  return records


def run_configs(bench: Bench, overrides: list[tuple[str, str]]) -> None:
  seq_len = _SEQ_LEN.value or 1024
  plans = []
  for spec in _CONFIGS.value:  # every config is checked before anything runs
    config = build_config(spec, overrides, batch=None, seq_len=seq_len)
    batches = [int(b) for b in _BATCH.value] or [config.batch_size]
    plans.append((spec, peers.peer_size(config.model), batches))
  timing = {"steps": _STEPS.value, "warmup": _WARMUP.value, "windows": _WINDOWS.value}
  peer_batches = {}
  for preset in _PRESETS.value:
    for spec, size, batches in plans:
      for first in batches:
        run = lambda b: bench.ours({"config": spec, "overrides": overrides, "batch": b, "seq": seq_len,
                                    "preset": preset, "peer_size": size, **timing}, child_env(preset))
        for record in searched(run, first, _BEST.value):
          if size and record.get("tokens_per_s"):
            peer_batches.setdefault(size, set()).add(first)
  if not _PEERS.value:
    return
  for size, firsts in peer_batches.items():
    for name in peers.SCRIPTS:
      for first in sorted(firsts):
        searched(lambda b: bench.peer(name, size, b), first, _BEST.value)


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
  unknown = [p for p in _PRESETS.value if p not in XLA_PRESETS]
  if unknown:
    raise ValueError(f"unknown XLA preset(s) {unknown}; choose from {', '.join(XLA_PRESETS)}.")
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
