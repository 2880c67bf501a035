"""Where a profiled step's device time goes: kernel time summed by the source line that emitted it.

  python train.py ... --config.profile_steps=2,4 --config.workdir=W     # with XLA_FLAGS=--xla_dump_to=D
  python tools/trace_top.py --trace=W/profile --hlo=D --steps=3

A trace (`config.profile_steps`, measure/profiling.py) names each kernel's HLO
instruction; the optimized HLO that XLA dumped (`--xla_dump_to`) names each
instruction's stack of source lines. Joining the two gives time per function
of meshlm (model/attention.py:attention is the attention kernel, the
transformer's loss function the head and loss chunks), the first caller outside
the generic helpers (model/layers.py's matmul) owning each kernel, without
TensorBoard, on the machine that ran the trace. Without --hlo the table is by
HLO instruction.

  python tools/trace_top.py --trace=runs/torch_trace.json.gz --steps=3   # tools/torch_profile.py's trace

A torch.profiler chrome trace (*.json, *.json.gz) is read the same way, by
kernel name, grouped by library (cuBLAS, flash attention, inductor's Triton
kernels, torch's own), so both sides of a comparison have one kind of table.
"""

import collections
import glob
import gzip
import json
import math
import os
import re
from pathlib import Path

from absl import app, flags

_TRACE = flags.DEFINE_string("trace", None, "A profile folder (its newest *.xplane.pb is read), or a torch.profiler "
                             "chrome trace (*.json, *.json.gz).", required=True)
_HLO = flags.DEFINE_string("hlo", "", "An --xla_dump_to folder holding the step's *after_optimizations.txt.")
_STEPS = flags.DEFINE_integer("steps", 1, "Steps the trace holds: times are per step.", lower_bound=1)
_TOP = flags.DEFINE_integer("top", 20, "Rows of the by-line table.", lower_bound=1)
_MODULE = flags.DEFINE_string("module", "train_step", "Only kernels of HLO modules whose name holds this.")

# One HLO instruction and its stack frame: `%fusion.12 = ... metadata={op_name="..." stack_frame_id=133}`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?stack_frame_id=(\d+)")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# Frames in these files say nothing about which part of the model a kernel serves: the caller does.
_GENERIC = ("model/layers.py", "model/placement.py", "model/fp8.py")
# Control flow's events span their bodies' kernels on a CPU's timeline: counting both would count twice.
_CONTROL = ("while", "conditional", "call")
_LIBRARIES = {"nvjet": "cuBLAS GEMM", "cutlass": "cuBLAS GEMM", "xmma": "cuBLAS GEMM", "cudnn": "cuDNN",
              "memcpy": "copy (memcpy)", "memset": "memset", "flash": "flash attention"}
_CHROME = (".json", ".json.gz")
_GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # a chrome trace's categories of device work


def _library(kernel: str) -> str:
  """`cuBLAS GEMM` for a library kernel of a command buffer, empty for one of XLA's own fusions."""
  return next((name for key, name in _LIBRARIES.items() if key in kernel.lower()), "")


def newest(pattern: str) -> str:
  found = sorted(glob.glob(pattern, recursive=True), key=os.path.getmtime)
  if not found:
    raise ValueError(f"nothing matches {pattern}; pass the folder that profile_steps or --xla_dump_to wrote.")
  return found[-1]


def kernel_times(trace_file: str, module: str) -> tuple[dict[str, float], dict[str, str], str]:
  """(nanoseconds per HLO instruction, a kernel name for each, which timeline was read).

  On a GPU the kernels sit on the device plane's stream lines; on a CPU the
  thunks sit on the host plane's threads. Either way each event names its HLO
  instruction in the `hlo_op` stat.
  """
  import jax.profiler  # pylint: disable=import-outside-toplevel
  data = jax.profiler.ProfileData.from_file(trace_file)
  planes = list(data.planes)
  devices = [p for p in planes if p.name.startswith("/device:")]
  times, kernels = collections.Counter(), {}
  for plane in devices or [p for p in planes if p.name.startswith("/host:CPU")]:
    lines = list(plane.lines)
    streams = [line for line in lines if line.name.startswith("Stream")]
    for line in streams or lines:
      for event in line.events:
        stats = dict(event.stats)
        op = stats.get("hlo_op")
        if op and module in str(stats.get("hlo_module", module)) and not op.startswith(_CONTROL):
          # Inside a command buffer (a CUDA graph) every kernel carries the buffer's name; XLA's own
          # kernels are named after their fusion (loop_add_fusion_3 for loop_add_fusion.3), library
          # kernels (cuBLAS, cuDNN, copies) after the library, which is then the best name there is.
          if op.startswith("command_buffer"):
            op = _library(event.name) or re.sub(r"_(\d+)$", r".\1", event.name)
          times[op] += event.duration_ns
          kernels.setdefault(op, event.name)
  where = "device streams" if devices else "host threads"
  return dict(times), kernels, where


def chrome_kernel_times(trace_file: str) -> tuple[dict[str, float], str]:
  """(nanoseconds per kernel name, which events were read) from a torch.profiler chrome trace.

  A GPU run's trace holds its kernels, copies and memsets. A CPU run's holds
  none: its operators are read instead, only those no other operator on the
  same thread encloses, so that nothing is counted twice.
  """
  with (gzip.open if trace_file.endswith(".gz") else open)(trace_file, "rt") as f:
    events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
  chosen = [e for e in events if e.get("cat") in _GPU_EVENTS]
  where = "GPU kernels"
  if not chosen:
    ends, where = {}, "outermost CPU operators"
    for event in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"]):
      thread = (event["pid"], event["tid"])
      if event["ts"] >= ends.get(thread, -math.inf):
        chosen.append(event)
        ends[thread] = event["ts"] + event["dur"]
  times = collections.Counter()
  for event in chosen:
    times[event["name"]] += event["dur"] * 1e3  # microseconds in the trace
  return dict(times), where


def _torch_group(kernel: str) -> str:
  return _library(kernel) or ("Triton (inductor)" if kernel.startswith("triton_") else "torch's own (ATen)")


def hlo_sources(dump: str, module: str) -> dict[str, tuple[str, str]]:
  """Each instruction of the dumped, optimized `module` to (its file, its `file:function:line` and caller).

  The dump ends with tables of file names, function names, locations and
  stack frames (each frame's parent_frame_id is one more than the parent's id,
  0 for none). An instruction's frame is walked outwards to meshlm's own code:
  the first frame outside the generic helpers names the owner.
  """
  text = Path(newest(os.path.join(dump, f"**/*{module}*after_optimizations.txt"))).read_text()
  tables, current = {name: {} for name in _TABLES}, None
  instructions = {}
  for line in text.splitlines():
    if line in _TABLES:
      current = line
    elif current and (row := re.match(r"^(\d+) (.*)$", line)):
      tables[current][int(row.group(1))] = row.group(2)
    elif match := _INSTRUCTION.match(line):
      instructions[match.group(1)] = int(match.group(2))
  field = lambda row, name: int(re.search(rf"{name}=(\d+)", row).group(1))

  def location(frame: int) -> tuple[str, str]:
    row = tables["FileLocations"][field(tables["StackFrames"][frame], "file_location_id")]
    path = _repo_relative(tables["FileNames"][field(row, "file_name_id")].strip('"'))
    function = tables["FunctionNames"][field(row, "function_name_id")].strip('"').split(".<locals>.")[-1]
    return path, f"{path}:{function}:{field(row, 'line')}"

  sources = {}
  for op, frame in instructions.items():
    chain = []
    while frame in tables["StackFrames"]:
      path, where = location(frame)
      if "packages/" not in where:
        chain.append((path, where))
      frame = field(tables["StackFrames"][frame], "parent_frame_id") - 1
    owner = next((c for c in chain if c[0] not in _GENERIC), chain[0] if chain else ("?", "?"))
    sources[op] = owner
  return sources


def _repo_relative(path: str) -> str:
  """model/attention.py for /anything/meshlm/model/attention.py; site-packages paths from the package on."""
  parts = Path(path).parts
  for anchor in ("site-packages", "dist-packages"):
    if anchor in parts:
      return "packages/" + "/".join(parts[parts.index(anchor) + 1:])
  for room in ("model", "parallel", "training", "measure", "run", "resilience", "input_pipeline"):
    if room in parts:
      return "/".join(parts[parts.index(room):])
  return "/".join(parts[-2:])


def table(rows: list[tuple], total: float, steps: int, header: str) -> str:
  """Rows of (name, nanoseconds[, the largest kernel's name]) as a markdown table."""
  kernels = len(rows[0]) > 2
  out = [f"| {header} | ms per step | share |{' its largest kernel |' if kernels else ''}",
         f"| --- | --- | --- |{' --- |' if kernels else ''}"]
  for name, ns, *kernel in rows:
    out.append(f"| {name} | {ns / steps / 1e6:.2f} | {ns / total:.1%} |{''.join(f' {k[:60]} |' for k in kernel)}")
  return "\n".join(out)


def main(argv):
  del argv
  if _TRACE.value.endswith(_CHROME):
    if not os.path.isfile(_TRACE.value):
      raise ValueError(f"{_TRACE.value} does not exist; pass the trace tools/torch_profile.py wrote.")
    times, where = chrome_kernel_times(_TRACE.value)
    by_group = collections.Counter()
    for kernel, ns in times.items():
      by_group[_torch_group(kernel)] += ns
    _print_tables(_TRACE.value, times, where, "kernel names", by_group,
                  [(k[:80], ns) for k, ns in collections.Counter(times).most_common(_TOP.value)], "kernel",
                  "library or kind")
    return
  trace = newest(os.path.join(_TRACE.value, "**/*.xplane.pb"))
  times, kernels, where = kernel_times(trace, _MODULE.value)
  if not times:
    raise ValueError(f"{trace} holds no kernel of a module named like {_MODULE.value!r}.")
  sources = hlo_sources(_HLO.value, _MODULE.value) if _HLO.value else {}
  by_source, by_file, example = collections.Counter(), collections.Counter(), {}
  for op, ns in times.items():
    path, key = sources.get(op, (op if op in _LIBRARIES.values() else "(no source line)", op))
    by_source[key] += ns
    by_file[path] += ns
    if key not in example or times[op] > times[example[key]]:
      example[key] = op
  _print_tables(trace, times, where, "HLO instructions", by_file,
                [(k, ns, kernels[example[k]]) for k, ns in by_source.most_common(_TOP.value)],
                "source (file:function:line)" if sources else "HLO instruction", "source file or library")


def _print_tables(trace: str, times: dict, where: str, what: str, by_group: collections.Counter, top: list,
                  top_header: str, group_header: str) -> None:
  """The per-step total (its first line is what tools/speed_table.py reads), then the two tables."""
  total = sum(times.values())
  print(f"{trace}: {total / _STEPS.value / 1e6:.2f} ms of kernels per step over {len(times)} {what} "
        f"({where}, {_STEPS.value} steps)\n")
  print(table(by_group.most_common(), total, _STEPS.value, group_header))
  print()
  print(table(top, total, _STEPS.value, top_header))


if __name__ == "__main__":
  app.run(main)
