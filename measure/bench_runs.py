"""What tools/bench.py runs and how: config specs, XLA flag presets, the CPU layouts, one measurement per process.

No absl flags here, so tests and other tools can import it.
"""

import functools
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from configs import load

ROOT = Path(__file__).resolve().parent.parent

# Measured one at a time (BENCHMARKS.md keeps what each gained). tools/bench.py refuses, before anything
# runs, a preset whose flag the installed jaxlib does not know (check_presets).
XLA_PRESETS = {
    "default": [],
    # Overlaps collectives with compute: nothing to overlap on one GPU (docs/benchmarks.md's example).
    "lhs": ["--xla_gpu_enable_latency_hiding_scheduler=true"],
    "cublas": ["--xla_gpu_enable_triton_gemm=false"],  # cuBLAS(Lt) for every GEMM instead of Triton
    # The flags that act on one GPU's step (../shared/research/gpu-step.md, section 2):
    "cudnn_ln": ["--xla_gpu_enable_cudnn_layer_norm=true"],  # LayerNorm's forward and backward as cuDNN kernels
    "lt": ["--xla_gpu_enable_cublaslt=true"],  # cuBLASLt GEMMs, whose epilogues can take the bias and GELU
    # The scan's stacked residual buffers: not zero-filled first, and written in place by the GEMMs.
    "dus0": ["--xla_gpu_enable_dus_accumulator_zero_init_elimination=true"],
    "dsf": ["--xla_gpu_enable_dynamic_slice_fusion=true"],
    "noremat": ["--xla_disable_hlo_passes=rematerialization"],  # no recompute XLA adds near the memory limit
}

GPT, LLAMA = "configs/gpt2.py:tiny", "configs/llama.py:tiny"
# (model, layout, config, overrides, devices). The first of each model is its single-device run. The
# Llama rows give it kv_heads=4 so that Ulysses can split the key/value heads four ways. A layout is
# a row here: in the dense model `expert` is one more data axis, in moe_tiny it holds the experts.
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
    ("gpt2 moe_tiny", "single device", GPT, {"moe.experts": 8}, 1),
    ("gpt2 moe_tiny", "data=2 x expert=4", GPT, {"moe.experts": 8, "mesh.data": 2, "mesh.expert": 4}, 8),
    ("llama tiny", "single device", LLAMA, {"model.kv_heads": 4}, 1),
    ("llama tiny", "data=2 x sequence=4 allgather", LLAMA,
     {"model.kv_heads": 4, "mesh.data": 2, "mesh.sequence": 4}, 8),
    ("llama tiny", "data=2 x sequence=4 ring", LLAMA,
     {"model.kv_heads": 4, "mesh.data": 2, "mesh.sequence": 4, "attention.context": "ring"}, 8),
    ("llama tiny", "data=2 x sequence=4 ulysses", LLAMA,
     {"model.kv_heads": 4, "mesh.data": 2, "mesh.sequence": 4, "attention.context": "ulysses"}, 8),
]


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
  # The step is measured, not the data pipeline.
  return load.set_fields(config, {"data.source": "synthetic", "model.max_len": seq_len,
                                  **({"batch_size": batch} if batch else {})})


def switched(spec: str, fields: list[str]) -> list[str]:
  """`spec` once per dotted field, each a true/false field flipped from its value there: one switch at a time."""
  config = build_config(spec, [], batch=None, seq_len=1024)
  specs = []
  for field in fields:
    value = functools.reduce(getattr, field.split("."), config)
    if not isinstance(value, bool):
      raise ValueError(f"{field} is {value!r} in {spec}, not a switch; name a true/false field.")
    specs.append(f"{spec},{field}={str(not value).lower()}")
  return specs


def batch_sizes(first: int, best: bool, max_batch: int) -> list[int]:
  """`first`, then with `best` its doublings up to `max_batch`: the batches a search may try."""
  sizes = [first]
  while best and sizes[-1] * 2 <= max_batch:
    sizes.append(sizes[-1] * 2)
  return sizes


def searched(measure_batch, sizes: list[int]) -> list[dict]:
  """Measure each size in turn, stopping after the first that gives no tokens/s (out of memory, error)."""
  records = []
  for batch in sizes:
    records.append(measure_batch(batch))
    if not records[-1].get("tokens_per_s"):
      break
  return records


def child_env(preset: str, devices: int | None = None) -> dict:
  """This environment plus the preset's XLA flags; with `devices`, that many simulated CPU devices."""
  extra = list(XLA_PRESETS[preset])
  env = dict(os.environ)
  if devices:
    extra.append(f"--xla_force_host_platform_device_count={devices}")  # after any earlier count: the last wins
    env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *extra]).strip()
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
  return env


def unknown_xla_flags(xla_flags: list[str]) -> list[str]:
  """Those of `xla_flags` the installed jaxlib does not know. XLA parses XLA_FLAGS when a backend starts
  and aborts naming every flag it does not know, GPU flags included on a CPU: one CPU-only child asks."""
  if not xla_flags:
    return []
  env = {**os.environ, "XLA_FLAGS": " ".join(xla_flags), "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                          text=True, timeout=300)
  if result.returncode == 0:
    return []
  named = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", result.stderr)
  if not named:
    why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
    raise ValueError(f"jax did not start with XLA_FLAGS={' '.join(xla_flags)}: {why[:300]}")
  return named.group(1).split()


def check_presets(names: list[str]) -> None:
  """Refuses, in one line, a preset that is not in XLA_PRESETS or that needs a flag this jaxlib lacks."""
  unknown = [name for name in names if name not in XLA_PRESETS]
  if unknown:
    raise ValueError(f"unknown XLA preset(s) {unknown}; choose from {', '.join(XLA_PRESETS)}.")
  missing = set(unknown_xla_flags(sorted({flag for name in names for flag in XLA_PRESETS[name]})))
  for name in names:
    lacking = [flag for flag in XLA_PRESETS[name] if flag in missing]
    if lacking:
      raise ValueError(f"XLA preset {name!r} needs {' '.join(lacking)}, which the installed jaxlib "
                       f"{metadata.version('jaxlib')} does not know; leave {name} out of --xla_presets.")


def run_child(run: dict, env: dict, timeout_s: float) -> dict:
  """One measurement in a fresh process (`tools/bench.py --run_one`) with `env`; its record."""
  command = [sys.executable, str(ROOT / "tools" / "bench.py"), f"--run_one={json.dumps(run)}"]
  try:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
  except subprocess.TimeoutExpired:
    return {**run, "error": f"timed out after {timeout_s:.0f} s"}
  lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
  if lines:
    return json.loads(lines[-1])
  why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
  return {**run, "error": why[:300]}


def measure_here(run: dict) -> dict:
  """The child's side: build the config and measure it in this process; jax is imported only here."""
  import jax  # pylint: disable=import-outside-toplevel
  from measure.benchmark import measure  # pylint: disable=import-outside-toplevel
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
