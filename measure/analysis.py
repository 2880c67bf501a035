"""Read a compiled XLA program and report the collectives and memory it holds.

Tests and `train.py --dry_run` use this to check what the partitioner really
did, e.g. that a tensor-parallel layer holds exactly two all-reduces over
`tensor`, and to set the bytes it moves beside the analytic model.

Device ids in the HLO are positions in the executable's device assignment (the
flattened mesh under `jax.jit`), not `device.id`: a mesh over a permuted device
list still prints `{0,1,2,3}`. We map positions to devices through the
executable (or mesh order, for HLO text), then devices to mesh coordinates.

Replica groups come in three spellings on jax 0.11, all handled here:
  explicit  replica_groups={{0,1},{2,3}}, source_target_pairs={{0,1},{1,0}}
  iota      replica_groups=[2,4]<=[8], replica_groups=[4,2]<=[2,4]T(1,0)
  mesh      replica_groups=mesh['data'=2,'tensor'=4] {'tensor'}, with sub-axes
            as 'data':(2)2 and a non-iota order as `, device_ids=(...)`.
The mesh spelling names the axes of the mesh the partitioner saw, which under
plain `jax.jit` shardings is anonymous (`axis_0`, size-1 axes dropped), so we
expand every spelling to device groups rather than trust the printed names.

Two readings of one program. The compiled HLO is what the backend made of it,
and the CPU backend rewrites collectives a GPU or TPU would not: it widens
bf16 all-reduces to float32 (its `all-reduce-promotion` pass) and never forms
reduce-scatters. `compile_partitioned` also keeps the HLO as the SPMD
partitioner left it, before any backend pass, where the partitioner writes a
reduce-scatter as an all-reduce whose only use is the device's 1/D
dynamic-slice; GPU and TPU compilers fuse that pair into a reduce-scatter
(XLA's ReduceScatterCreator), and so does our reading of it; likewise an
all-reduce of an all-reduce is one over both groups (AllReduceFolder), and the
sum of two like all-reduces one all-reduce of the sum (AllReduceReassociate).
"""

import collections
import contextlib
import dataclasses
import fractions
import functools
import glob
import itertools
import os
import re
import tempfile
from typing import NamedTuple

import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from measure import tiers
from parallel import jax_compat
from parallel.mesh import slow_tier_groups

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
         "ragged-all-to-all", "collective-permute")

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(\S+)\s*=\s*(.+?)\s(" + "|".join(KINDS) + r")(-start)?\(")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|true_computation|"
    r"false_computation)=(?:\{([^}]*)\}|%?([\w.\-]+))")
_IOTA = r"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
_IOTA_GROUPS = re.compile(rf"replica_groups=({_IOTA})")
# device_ids, printed only for a non-iota mesh, is an iota or a plain list.
_MESH_GROUPS = re.compile(
    rf"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(({_IOTA}|[\d,\s]*)\))?"
    r"\s*\{([^}]*)\}")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_BRANCHES = ("branch_computations", "true_computation", "false_computation")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?\s*)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  `axes` are the mesh axes along which members of one replica group differ, in
  mesh order; `group_size` is the devices per group (for collective-permute,
  the devices one chain of source-target pairs connects). `loop_depth` counts
  the while loops around the computation it sits in, and `loop_body` names the
  innermost one's body (None outside loops); a collective in a scanned body is
  listed once, not once per trip. `trips` is how often it runs per call: the
  product of the known trip counts of the loops around it (a loop whose count
  XLA does not know counts once).
  """
  kind: str
  name: str
  computation: str
  loop_depth: int
  loop_body: str | None
  result_bytes: int
  axes: tuple[str, ...]
  group_size: int
  trips: int = 1
  # Two network tiers (parallel.mesh.slow_tier_shape): the slow-tier groups (slices or hosts) one
  # replica group spans, and for a permute the share of its pairs whose ends lie in different ones.
  slow_groups: int = 1
  crossing_pairs: fractions.Fraction = fractions.Fraction(0)

  @property
  def in_loop(self) -> bool:
    return self.loop_depth > 0


@contextlib.contextmanager
def _without_persistent_cache():
  """Compiles inside skip JAX's persistent compilation cache. JAX decides once per process whether
  the cache is in use, so that decision is reset on the way in and again on the way out."""
  compilation_cache.reset_cache()
  try:
    with jax_compat.compilation_cache_disabled():
      yield
  finally:
    compilation_cache.reset_cache()


def compile_partitioned(lowered):
  """Compiles `lowered`: the executable, and its HLO text right after SPMD partitioning.

  XLA writes the module as the `spmd-partitioning` pass leaves it to a dump
  folder, a fresh one per call. JAX's persistent compilation cache leaves dump
  options out of its key, so it is bypassed here: an executable read back from
  it would skip the dump. A program for one device is not partitioned: its
  module before optimisations is the same program.
  """
  with tempfile.TemporaryDirectory() as folder, _without_persistent_cache():
    compiled = lowered.compile({"xla_dump_to": folder, "xla_dump_hlo_pass_re": "spmd-partitioning",
                                "xla_dump_disable_metadata": True})
    dumps = (glob.glob(os.path.join(folder, "*.after_spmd-partitioning.*.txt"))
             or glob.glob(os.path.join(folder, "*.before_optimizations.txt")))
    if len(dumps) != 1:
      raise RuntimeError(f"expected one HLO dump after spmd-partitioning, found {len(dumps)} in {folder}")
    with open(dumps[0]) as dump:
      return compiled, dump.read()


def collectives(compiled_or_hlo_text, mesh, partitioned: str | None = None,
                busy: dict[int, int] | None = None, slow: dict[str, int] | None = None) -> list[Collective]:
  """Lists the collectives of a compiled program (or its HLO text) over `mesh`.

  With `partitioned` (the text `compile_partitioned` returns beside the
  executable), lists those of the program before the backend's passes, as
  a GPU or TPU compiler would receive it (module docstring), with each loop's
  trips read off the compiled program's loop of the same name. `busy` maps a
  loop's trips to how many of them a conditional directly in its body runs
  (`busy_slots`); without it every trip counts. `slow` (slow-tier groups per
  axis, parallel.mesh.slow_tier_shape) reads off each replica group which
  slices or hosts it spans.
  Async pairs count once (the `-start`; `-done` is skipped). Raises ValueError
  on a collective whose replica groups we cannot read, so a new XLA spelling
  fails loudly instead of vanishing from the counts.
  """
  is_text = isinstance(compiled_or_hlo_text, str)
  text = compiled_or_hlo_text if is_text else compiled_or_hlo_text.as_text()
  coords = _position_coords(mesh, None if is_text else compiled_or_hlo_text)
  tier_group = slow_tier_groups(mesh, slow or {})
  group_of = {position: int(tier_group[c]) for position, c in coords.items()}
  known_trips = {}
  if partitioned is not None:
    known_trips, text = _trip_counts(text), partitioned
  module = _parse(text, known_trips)
  depth, loop_body, trips = _loop_nesting(module, busy or {})
  lines = module.lines
  uses = _uses(lines) if partitioned is not None else {}
  found = {}
  for line_number, line in enumerate(lines):
    if partitioned is not None and (copied := _copied(line, found, uses)):
      # A copy that only relays a collective's result (the simplifier removes it) stands for the collective.
      found[copied[0]] = dataclasses.replace(found.pop(copied[1]), name=copied[0])
      continue
    if partitioned is not None and (summed := _reassociated(line, found, uses)):
      # XLA's AllReduceReassociate: the sum of two all-reduces over the same devices, each read by the sum
      # alone, is one all-reduce of the sum (a layer's input gradient from its q, k, v projections).
      first, _ = (found.pop(operand) for operand in summed[1:])
      found[summed[0]] = dataclasses.replace(first, name=summed[0])
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, result_type, kind, start = match.groups()
    groups = parse_groups(line, mesh.size)
    axes = {a for g in groups for a in _differing_axes(g, coords, mesh)}
    computation = module.where.get(line_number, "")
    found[name] = Collective(
        kind=kind, name=name, computation=computation,
        loop_depth=depth.get(computation, 0),
        loop_body=loop_body.get(computation),
        result_bytes=_result_bytes(result_type, kind, bool(start)),
        axes=tuple(a for a in mesh.axis_names if a in axes),
        group_size=_group_size(groups, kind), trips=trips.get(computation, 1),
        **_tiers(groups, kind, group_of))
    operand = _all_reduce_operand(line) if kind == "all-reduce" else None
    if operand in found and found[operand].kind == "all-reduce" and uses.get(operand) == [("all-reduce", 0, 0)]:
      # XLA's AllReduceFolder: an all-reduce of an all-reduce is one over both groups.
      inner = found.pop(operand)
      found[name] = dataclasses.replace(
          found[name], axes=tuple(a for a in mesh.axis_names if a in axes | set(inner.axes)),
          group_size=found[name].group_size * inner.group_size,
          slow_groups=found[name].slow_groups * inner.slow_groups)
  for name, c in found.items():
    # XLA's ReduceScatterCreator: an all-reduce whose one use keeps this device's 1/D of it.
    if c.kind == "all-reduce" and len(uses.get(name, ())) == 1 and uses[name][0][:2] == ("dynamic-slice", 0) \
        and uses[name][0][2] * c.group_size == c.result_bytes:
      found[name] = dataclasses.replace(c, kind="reduce-scatter", result_bytes=uses[name][0][2])
  return list(found.values())


_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s*=\s*(.+?)\s([\w\-]+)\((.*)")


def _operands(rest: str) -> list[str]:
  return re.findall(r"%([\w.\-]+)", rest.split("), ")[0])


def _copied(line: str, found: dict, uses: dict) -> tuple[str, str] | None:
  """(the copy, its operand) where `line` copies a collective's result and is its one use, else None."""
  definition = _DEFINITION.match(line)
  if not definition or definition.group(3) != "copy":
    return None
  operands = _operands(definition.group(4))
  ok = len(operands) == 1 and operands[0] in found and len(uses.get(operands[0], ())) == 1
  return (definition.group(1), operands[0]) if ok else None


def _reassociated(line: str, found: dict, uses: dict) -> tuple[str, str, str] | None:
  """(the add, its two operands) where `line` adds two like all-reduces whose one use it is, else None."""
  definition = _DEFINITION.match(line)
  if not definition or definition.group(3) != "add":
    return None
  operands = _operands(definition.group(4))
  if len(operands) != 2 or not all(o in found and found[o].kind == "all-reduce" for o in operands):
    return None
  one, two = (found[o] for o in operands)
  alike = (one.axes, one.group_size, one.result_bytes, one.computation) == (
      two.axes, two.group_size, two.result_bytes, two.computation)
  only_use = all(len(uses.get(o, ())) == 1 for o in operands)
  return (definition.group(1), *operands) if alike and only_use else None


def _all_reduce_operand(line: str) -> str | None:
  operands = _operands(_DEFINITION.match(line).group(4))
  return operands[0] if len(operands) == 1 else None


def _uses(lines) -> dict[str, list[tuple[str, int, int]]]:
  """Per instruction name: (opcode, operand position, result bytes) of each instruction that reads it.

  Names are unique within an HLO module, so uses are found by name.
  """
  uses = collections.defaultdict(list)
  for line in lines:
    if match := _DEFINITION.match(line):
      _, result_type, opcode, rest = match.groups()
      for position, operand in enumerate(_operands(rest)):
        size = _result_bytes(result_type, opcode, False) if opcode == "dynamic-slice" else 0
        uses[operand].append((opcode, position, size))
  return dict(uses)


# An operand may be a tuple's element, `%param#1`, as newer HLO text writes a get-tuple-element.
_DOT = re.compile(r"\bdot\(%([\w.\-]+(?:#\d+)?), %([\w.\-]+(?:#\d+)?)\).*?lhs_contracting_dims=\{([\d,]*)\}")
_ARRAY_TYPE = re.compile(r"\w+\[[\d,]*\]")


def matmul_flops(compiled, partitioned: str, busy: dict[int, int] | None = None) -> int:
  """FLOPs of the dots in one device's program as partitioned: 2 x result elements x contracted size each,
  loop bodies times their trips (read off `compiled` as `collectives` does), and of a conditional only
  its costliest branch, the one a device may run (a 1F1B slot is a forward or a backward, not both),
  on `busy[n]` of the trips of a loop of n trips around it (`busy_slots`), else on every trip.

  `compiled.cost_analysis()` also reports per-device FLOPs, but counts a while
  loop's body once whatever its trips (a scanned layer stack as one layer).
  """
  module, busy = _parse(partitioned, _trip_counts(compiled.as_text())), busy or {}
  own = collections.Counter()
  for line_number, line in enumerate(module.lines):
    if dot := _DOT.search(line):
      lhs, _, contracting = dot.groups()
      lhs_dims = _ints(re.search(r"\[([^\]]*)\]", module.types[lhs]).group(1))
      result_dims = _ints(re.search(r"\[([^\]]*)\]", _DEFINITION.match(line).group(2)).group(1))
      contracted = int(np.prod([lhs_dims[i] for i in _ints(contracting)], dtype=np.int64))
      own[module.where[line_number]] += 2 * int(np.prod(result_dims, dtype=np.int64)) * contracted

  @functools.cache
  def cost(computation: str, loop_trips: int | None) -> fractions.Fraction:
    """FLOPs of one run of `computation`, which sits (directly or through calls) in a loop of `loop_trips`."""
    total = fractions.Fraction(own[computation])
    for call in module.calls.get(computation, ()):
      inner = call.trips if call.loop else None if call.branches else loop_trips
      share = fractions.Fraction(busy[loop_trips], loop_trips) if call.branches and loop_trips in busy else 1
      total += call.trips * share * max(cost(callee, inner) for callee in call.callees)
    return total

  return int(cost(module.entry, None))


class _Call(NamedTuple):
  """One instruction's call of other computations: a loop's body or condition, a conditional's
  branches (one of which runs), or a plain call (fusion, reduction, map)."""
  callees: tuple[str, ...]
  trips: int  # the loop's for its body and condition, else 1
  loop: str | None  # the loop's body name for its body and condition (a while names its loop by the body)
  branches: bool


@dataclasses.dataclass(frozen=True)
class _Module:
  """An HLO module's text read once: its lines, which computation each sits in, each computation's
  calls, and the type of every instruction and parameter (a tuple's elements as `name#i`)."""
  lines: list[str]
  entry: str
  where: dict[int, str]
  calls: dict[str, list[_Call]]
  types: dict[str, str]


def _parse(text: str, known_trips: dict[str, int]) -> _Module:
  """Reads `text` into a _Module. A loop whose trip count the text does not carry takes it from
  `known_trips` (by body base name), else counts once."""
  lines, where, calls, types, current, entry = text.splitlines(), {}, {}, {}, None, None
  headers = {}
  for line_number, line in enumerate(lines):
    if line and not line[0].isspace() and line.rstrip().endswith("{") and not line.startswith("HloModule"):
      current = line.removeprefix("ENTRY").split()[0].lstrip("%")
      entry = current if line.startswith("ENTRY") else entry
      calls[current] = []
      # Parameters are typed in the header.
      headers.update(re.findall(r"%?([\w.\-]+): (\((?:[^()]|\([^()]*\))*\)|\w+\[[\d,]*\])", line))
      continue
    if current is None:
      continue
    where[line_number] = current
    if definition := _DEFINITION.match(line):
      types[definition.group(1)] = definition.group(2)
    body, count = re.search(r"\bbody=%?([\w.\-]+)", line), _TRIP_COUNT.search(line)
    trips = int(count.group(1)) if count else _known_trips(body.group(1), known_trips) if body else 1
    branches = []
    for attribute, listed, single in _CALLEE.findall(line):
      callees = [callee.lstrip("%") for callee in (re.split(r",\s*", listed) if listed else [single])]
      if attribute in _BRANCHES:
        branches += callees
      else:
        is_loop = attribute in ("body", "condition")
        calls[current] += [_Call((callee,), trips if is_loop else 1, body.group(1) if is_loop else None, False)
                           for callee in callees]
    if branches:
      calls[current].append(_Call(tuple(branches), 1, None, True))
  types.update(headers)  # a parameter's header type wins over an instruction of the same name
  # A tuple-valued instruction's or parameter's elements are named `name#i` where used.
  types.update({f"{name}#{i}": element for name, kind in list(types.items()) if kind.startswith("(")
                for i, element in enumerate(_ARRAY_TYPE.findall(kind))})
  return _Module(lines, entry, where, calls, types)


def _trip_counts(compiled_text: str) -> dict[str, int]:
  """Known trip counts of a compiled program's while loops, by body name without `wide.` prefixes."""
  counts = {}
  for line in compiled_text.splitlines():
    body, count = re.search(r"\bbody=%?([\w.\-]+)", line), _TRIP_COUNT.search(line)
    if body and count:
      counts[re.sub(r"^(wide\.)+", "", body.group(1))] = int(count.group(1))
  return counts


def _known_trips(body: str, known_trips: dict[str, int]) -> int:
  """The trips of the loop named `body` before backend passes, which copy it under suffixed names (`.clone`, `.sunk`).

  Counts once where no compiled loop, or loops of different lengths, carry the name.
  """
  counts = {n for name, n in known_trips.items() if name == body or name.startswith(body + ".")}
  return counts.pop() if len(counts) == 1 else 1


def parse_groups(line: str, num_devices: int) -> list[list[int]]:
  """Device-position groups of one collective line; pairs for permutes."""
  if match := _PAIRS.search(line):
    return [[int(i) for i in p.split(",")]
            for p in re.findall(r"\{(\d+,\d+)\}", match.group(1))]
  if match := _MESH_GROUPS.search(line):
    return _mesh_groups(*match.groups())
  if match := _IOTA_GROUPS.search(line):
    return iota_groups(match.group(1))
  if match := _LIST_GROUPS.search(line):
    groups = [[int(i) for i in g.split(",") if i.strip()]
              for g in re.findall(r"\{([\d,\s]*)\}", match.group(1))]
    # `replica_groups={}` means one group of every device.
    return groups or [list(range(num_devices))]
  raise ValueError(f"cannot read the replica groups of: {line.strip()[:200]}")


def iota_groups(text: str) -> list[list[int]]:
  """Expands `[G,S]<=[dims]T(perm)`: iota over dims, transposed, as G groups."""
  shape, dims, perm = re.fullmatch(
      r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip()).groups()
  ids = np.arange(np.prod(_ints(dims))).reshape(_ints(dims))
  if perm:
    ids = ids.transpose(_ints(perm))
  return ids.reshape(_ints(shape)).tolist()


def _mesh_groups(mesh_text, device_ids, axes_text) -> list[list[int]]:
  """Expands `mesh[a=2,b=4] {b}`: devices that differ only along the listed axes."""
  named = re.findall(r"'?([^'=,\s]+)'?=(\d+)", mesh_text)
  names, sizes = [n for n, _ in named], [int(s) for _, s in named]
  if not device_ids:
    ids = np.arange(np.prod(sizes))
  elif "<=" in device_ids:
    ids = np.array(iota_groups(device_ids))
  else:
    ids = np.array(_ints(device_ids))
  ids = ids.reshape(sizes)
  # A sub-axis 'x':(pre)size is the middle factor of x split major-to-minor as
  # [pre, size, rest]; a full axis is the sub-axis (1)size(x).
  grouped = collections.defaultdict(list)
  for axis_name, pre, size in re.findall(
      r"'?([^',:\s]+)'?(?::\((\d+)\)(\d+))?", axes_text):
    grouped[names.index(axis_name)].append(
        (int(pre), int(size)) if size else (1, sizes[names.index(axis_name)]))
  groups = collections.defaultdict(list)
  for index in itertools.product(*(range(s) for s in sizes)):
    key = []
    for axis, coordinate in enumerate(index):
      for pre, size in grouped.get(axis, ()):
        rest = sizes[axis] // (pre * size)
        coordinate -= (coordinate // rest) % size * rest
      key.append(coordinate)
    groups[tuple(key)].append(int(ids[index]))
  return list(groups.values())


def _ints(text: str) -> list[int]:
  return [int(i) for i in re.findall(r"\d+", text)]


def _position_coords(mesh, compiled) -> dict[int, tuple[int, ...]]:
  """Maps each device position in the HLO to its mesh coordinates."""
  devices = list(mesh.devices.flat)  # What jit assigns over one mesh.
  try:
    assigned = list(compiled.runtime_executable().local_devices())
  except Exception:  # HLO text, or a stage object without an executable.
    assigned = []
  # Multi-host executables list only their local devices: keep mesh order.
  devices = assigned if len(assigned) == mesh.size else devices
  by_id = {d.id: index for index, d in np.ndenumerate(mesh.devices)}
  return {position: by_id[d.id] for position, d in enumerate(devices)}


def _differing_axes(group, coords, mesh) -> set[str]:
  """Mesh axes along which the members of one group do not all agree."""
  members = np.array([coords[i] for i in group])
  return {mesh.axis_names[a] for a in range(members.shape[1])
          if len(set(members[:, a])) > 1}


def _tiers(groups, kind, group_of: dict[int, int]) -> dict:
  """Collective's slow_groups (the most slow-tier groups one replica group spans) or, for a
  permute, crossing_pairs."""
  if kind == "collective-permute":
    crossing = sum(group_of[source] != group_of[target] for source, target in groups)
    return {"crossing_pairs": fractions.Fraction(crossing, len(groups)) if groups else fractions.Fraction(0)}
  return {"slow_groups": max(len({group_of[i] for i in g}) for g in groups)}


def _group_size(groups, kind) -> int:
  """Devices per replica group; for permutes, the largest chain of pairs."""
  if kind != "collective-permute":
    return max(len(g) for g in groups)
  chain = {}
  for source, target in groups:
    joined = chain.get(source, {source}) | chain.get(target, {target})
    chain.update(dict.fromkeys(joined, joined))
  return max(map(len, chain.values()), default=1)


def _result_bytes(result_type: str, kind: str, is_start: bool) -> int:
  """Bytes of the result; for async starts, only the output buffer."""
  text = re.sub(r"\{[^{}]*\}", "", result_type)  # Layouts may hold parens.
  # all-gather-start and collective-permute-start return (operand, output,
  # ...): the output is what moves. all-reduce-start returns the output alone.
  if is_start and kind in ("all-gather", "collective-permute"):
    depth, parts = 0, [""]
    for char in text[1:-1]:
      depth += (char in "([") - (char in ")]")
      if char == "," and depth == 0:
        parts.append("")
      else:
        parts[-1] += char
    text = parts[1] if len(parts) > 1 else text
  return sum(_array_bytes(dtype, _ints(dims))
             for dtype, dims in re.findall(r"(\w+)\[([^\]]*)\]", text))


def _array_bytes(dtype: str, dims: list[int]) -> int:
  # HLO type names carry their width (s8, bf16, f8e4m3fn, c64), except two.
  width = re.match(r"[a-z]+(\d+)", dtype)
  bits = {"pred": 8, "token": 0}.get(dtype) if not width else int(width[1])
  if bits is None:
    raise ValueError(f"unknown HLO element type {dtype!r}")
  # Sub-byte types (s4, f4e2m1fn) pack, so round up.
  return -(-int(np.prod(dims, dtype=np.int64)) * bits // 8)


def _loop_nesting(module: _Module, busy: dict[int, int]):
  """Per computation: while loops around it, the innermost body's name, and the trips it runs.

  A conditional's branches run on `busy[n]` of the trips of a loop of n trips
  whose body holds it (directly or through calls), else on every trip.
  """
  entry = module.entry
  depth, loop_body, trips, loop_trips = {entry: 0}, {}, {entry: 1}, {entry: None}
  pending = [entry]
  while pending:  # A worklist: a computation may have several callers.
    caller = pending.pop()
    for call in module.calls.get(caller, ()):
      for callee in call.callees:
        new_depth = depth[caller] + (call.loop is not None)
        if new_depth <= depth.get(callee, -1):
          continue
        depth[callee] = new_depth
        loop_body[callee] = call.loop or loop_body.get(caller)
        trips[callee] = trips[caller] * call.trips
        loop_trips[callee] = call.trips if call.loop else None if call.branches else loop_trips[caller]
        if call.branches and loop_trips[caller] in busy:
          trips[callee] = trips[caller] // loop_trips[caller] * busy[loop_trips[caller]]
        pending.append(callee)
  return depth, loop_body, trips


def count_by(found, kind=None, axes=None, in_loop=None) -> int:
  """Counts collectives matching every filter given; `axes` compares as a set."""
  if isinstance(axes, str):
    axes = (axes,)
  return sum(1 for c in found
             if (kind is None or c.kind == kind)
             and (axes is None or set(c.axes) == set(axes))
             and (in_loop is None or c.in_loop == in_loop))


def ring_traffic_bytes(collective: Collective) -> int:
  """Bytes one device sends for this collective under the ring algorithms.

  With N the full buffer size and D the group size: all-reduce 2N(D-1)/D
  (reduce-scatter then all-gather); all-gather and reduce-scatter N(D-1)/D,
  N the gathered size, i.e. result bytes for all-gather and result bytes * D
  for reduce-scatter; all-to-all N(D-1)/D with N its result bytes (each device
  keeps 1/D of its data); collective-permute N, one send per device. Counted
  once per instruction, so a collective in a loop body is not multiplied by
  the trip count.
  """
  size, d = collective.result_bytes, collective.group_size
  if collective.kind == "all-reduce":
    return 2 * size * (d - 1) // d
  if collective.kind == "reduce-scatter":
    return size * (d - 1)
  if collective.kind == "collective-permute":
    return size
  return size * (d - 1) // d


def collective_bytes(found, ring: bool = False) -> dict[str, int]:
  """Total result bytes per kind, or ring traffic per device with `ring`."""
  totals = collections.Counter()
  for c in found:
    totals[c.kind] += ring_traffic_bytes(c) if ring else c.result_bytes
  return dict(totals)


def tier_traffic_per_step(found) -> dict[tuple[str, str], dict[str, int]]:
  """traffic_per_step split by network tier: {"fast": ..., "slow": ...} bytes (measure/tiers.py)."""
  totals = collections.defaultdict(collections.Counter)
  for c in found:
    sent = ring_traffic_bytes(c) * c.trips
    crossing = int(sent * tiers.slow_share(c.kind, c.group_size // c.slow_groups, c.slow_groups, c.crossing_pairs))
    totals[(c.kind, "+".join(c.axes) or "-")].update({tiers.FAST: sent - crossing, tiers.SLOW: crossing})
  return {key: {tiers.FAST: t[tiers.FAST], tiers.SLOW: t[tiers.SLOW]} for key, t in totals.items()}


def traffic_per_step(found) -> dict[tuple[str, str], int]:
  """Ring bytes one device sends per call, by (kind, axes joined by "+"), each loop body times its trips."""
  totals = collections.Counter()
  for c in found:
    totals[(c.kind, "+".join(c.axes) or "-")] += ring_traffic_bytes(c) * c.trips
  return dict(totals)


def summary_table(found) -> str:
  """A text table: count and bytes per (kind, axes, in loop body)."""
  rows = collections.defaultdict(lambda: [0, 0, 0])
  for c in found:
    row = rows[(c.kind, ",".join(c.axes) or "-", "loop" if c.in_loop else "")]
    row[0] += 1
    row[1] += c.result_bytes
    row[2] += ring_traffic_bytes(c)
  lines = [f"{'kind':<19}{'axes':<22}{'where':<6}{'count':>6}"
           f"{'result bytes':>15}{'ring bytes':>15}"]
  for (kind, axes, where), (count, size, ring) in sorted(rows.items()):
    lines.append(f"{kind:<19}{axes:<22}{where:<6}{count:>6}{size:>15,}{ring:>15,}")
  return "\n".join(lines)


_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
}


def memory_summary(compiled) -> dict[str, int]:
  """Per-device memory of a compiled program, from `memory_analysis()`.

  `peak_bytes` estimates the live peak as arguments + outputs + temps - aliased
  (donated inputs reused as outputs). `xla_peak_bytes` is the backend's own
  figure where it reports one (0 otherwise). Missing fields read as 0, since
  backends differ in what they fill in and some return no analysis at all.
  """
  try:
    stats = compiled.memory_analysis()
  except Exception:  # Some backends raise instead of returning None.
    stats = None
  summary = {key: int(getattr(stats, field, 0) or 0)
             for key, field in _MEMORY_FIELDS.items()}
  summary["peak_bytes"] = (summary["argument_bytes"] + summary["output_bytes"]
                           + summary["temp_bytes"] - summary["alias_bytes"])
  summary["xla_peak_bytes"] = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
  return summary
