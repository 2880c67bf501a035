"""The five-axis device mesh, built from `config.mesh`."""

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# Outermost (slowest links) to innermost (fastest): tensor parallelism wants
# NVLink/ICI neighbours, pipeline stages tolerate slow links.
DATA, PIPELINE, EXPERT, SEQUENCE, TENSOR = "data", "pipeline", "expert", "sequence", "tensor"
AXES = (DATA, PIPELINE, EXPERT, SEQUENCE, TENSOR)
# The axes whose collectives tolerate the slow tier between slices or hosts (DCN, InfiniBand): data
# replicas reduce once per step and pipeline stages hand over one activation per tick; tensor, sequence
# and expert parallelism exchange activations inside every layer.
SLOW_TIER_AXES = (DATA, PIPELINE)


def mesh_sizes(text: str) -> dict[str, int]:
  """A command line's `data=2,tensor=4` as mesh sizes, every axis not named set to 1 (sample.py, tools/evaluate.py)."""
  sizes = dict.fromkeys(AXES, 1)
  for item in text.split(","):
    axis, _, size = item.partition("=")
    if axis not in AXES or not size.lstrip("-").isdigit():
      raise ValueError(f"--mesh item {item!r} is not axis=size with an axis among {', '.join(AXES)}.")
    sizes[axis] = int(size)
  return sizes


def mesh_shape(mesh_config, device_count: int) -> dict[str, int]:
  """Axis sizes with the single `-1` (if any) filled by the devices left over."""
  sizes = {axis: int(mesh_config[axis]) for axis in AXES}
  bad = {a: s for a, s in sizes.items() if s == 0 or s < -1}
  if bad:
    raise ValueError(f"mesh sizes must be positive or -1 (fill), got {bad}.")
  fills = [a for a, s in sizes.items() if s == -1]
  if len(fills) > 1:
    raise ValueError(f"only one mesh axis may be -1 (fill), got {fills}; give the others sizes.")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if fills:
    if device_count % fixed:
      raise ValueError(
          f"mesh {_describe(sizes)} cannot fill {device_count} devices: the fixed axes multiply "
          f"to {fixed}, and {fixed} does not divide {device_count}.")
    sizes[fills[0]] = device_count // fixed
  if math.prod(sizes.values()) != device_count:
    raise ValueError(
        f"mesh {_describe(sizes)} has {math.prod(sizes.values())} devices but {device_count} are "
        f"present; make the sizes multiply to {device_count} or set one axis to -1.")
  return sizes


def hybrid_shape(shape: dict[str, int], fsdp_group: int) -> dict[str, int]:
  """HSDP (sharding.fsdp_group=G): the `data` devices as data/G replica groups of G devices on `expert`.

  ZeRO then shards within each group (parallel/rules.py fsdp_axis) and `data`
  holds the replicas; `expert` lies inside `data`, so a group's devices are
  neighbours (one host's fast links) while replicas span hosts. The batch
  splits over both, as always. A mixture-of-experts model's experts split over the
  groups too, each group a whole expert-parallel set (MaxText and torchtitan run
  expert parallelism inside the FSDP group the same way); `expert` is otherwise idle.
  """
  if fsdp_group < 0:
    raise ValueError(f"sharding.fsdp_group={fsdp_group} is negative; use 0 (ZeRO over all of data) or a group size.")
  if not fsdp_group:
    return shape
  if shape[EXPERT] != 1:
    raise ValueError(f"sharding.fsdp_group={fsdp_group} runs the ZeRO groups on the expert axis, so mesh.expert "
                     f"must be 1, got {shape[EXPERT]}; a MoE model's experts split over the groups, so leave mesh.expert at 1.")
  if shape[DATA] % fsdp_group:
    raise ValueError(f"mesh.data={shape[DATA]} does not split into groups of sharding.fsdp_group={fsdp_group} "
                     "devices; choose a group size that divides it.")
  return {**shape, DATA: shape[DATA] // fsdp_group, EXPERT: fsdp_group}


def slow_tier_shape(mesh_config, shape: dict[str, int]) -> dict[str, int]:
  """How many slow-tier groups (slices or hosts) each axis spans: `mesh.dcn_<axis>`, 1 where unset.

  `mesh.<axis>` stays the axis's whole size; `mesh.dcn_<axis>` of it runs across the slow tier, the
  rest inside each group, so `shape` is the mesh after hybrid_shape (ZeRO groups stay inside a group).
  """
  slow = {axis: int(mesh_config.get(f"dcn_{axis}", 1)) for axis in AXES}
  for axis, count in slow.items():
    if count < 1:
      raise ValueError(f"mesh.dcn_{axis}={count} must be a positive number of slices or hosts (1: none).")
    if count > 1 and axis not in SLOW_TIER_AXES:
      raise ValueError(f"mesh.dcn_{axis}={count} would put {axis} parallelism's per-layer collectives on the "
                       f"slow network between slices or hosts; only {' and '.join(SLOW_TIER_AXES)} may cross "
                       f"it (mesh.dcn_data, mesh.dcn_pipeline), so set mesh.dcn_{axis}=1.")
    if shape[axis] % count:
      raise ValueError(f"mesh.dcn_{axis}={count} does not divide the {axis} axis of {shape[axis]} devices; "
                       f"choose a number of slices or hosts that divides it.")
  return slow


def make_mesh(mesh_config, devices=None, fsdp_group: int = 0) -> Mesh:
  """A mesh over `devices` (all by default) with every axis in Auto mode; `fsdp_group` as hybrid_shape.

  Auto rather than Explicit: shardings come from the logical rules as
  constraints and GSPMD propagates the rest, the way MaxText runs by default;
  Explicit would make every contraction over a sharded dimension spell out its
  output sharding inside the model, which must stay mesh-agnostic.
  With `mesh.dcn_*` the devices are laid out over two network tiers (hybrid_grid).
  """
  devices = jax.devices() if devices is None else devices
  shape = hybrid_shape(mesh_shape(mesh_config, len(devices)), fsdp_group)
  slow = slow_tier_shape(mesh_config, shape)
  axis_types = (AxisType.Auto,) * len(AXES)
  if math.prod(slow.values()) > 1:
    return Mesh(hybrid_grid(shape, slow, devices), AXES, axis_types=axis_types)
  if len(devices) == jax.device_count():
    return jax.make_mesh(tuple(shape[a] for a in AXES), AXES, axis_types=axis_types, devices=devices)
  device_grid = np.asarray(devices).reshape(tuple(shape[a] for a in AXES))
  return Mesh(device_grid, AXES, axis_types=axis_types)


class _SimulatedSlice:
  """A device of one process standing in one of several slices: create_hybrid_device_mesh groups
  devices by `slice_index`, which one process's devices share."""

  def __init__(self, device, slice_index: int):
    self.device, self.slice_index = device, slice_index

  def __getattr__(self, name):
    return getattr(self.device, name)


def hybrid_grid(shape: dict[str, int], slow: dict[str, int], devices) -> np.ndarray:
  """The devices as a grid of `shape`, each axis's slow-tier part outermost (create_hybrid_device_mesh).

  The groups are TPU slices where the devices span several, else processes (one per GPU host),
  else, in one process (the dry run, the tests), equal runs of consecutive devices standing for them.
  """
  groups = math.prod(slow.values())
  inner = [shape[a] // slow[a] for a in AXES]
  outer = [slow[a] for a in AXES]
  slices = {getattr(d, "slice_index", 0) for d in devices}
  processes = {d.process_index for d in devices}
  if len(slices) > 1 or len(processes) > 1:
    found, what = (len(slices), "slices") if len(slices) > 1 else (len(processes), "processes")
    if found != groups:
      raise ValueError(f"mesh.dcn_* ask for {groups} slow-tier groups (slices or hosts), but the devices span "
                       f"{found} {what}; make the mesh.dcn_* sizes multiply to {found}.")
    return mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=len(slices) <= 1)
  per_group = len(devices) // groups
  standing_in = [_SimulatedSlice(d, i // per_group) for i, d in enumerate(devices)]
  grid = mesh_utils.create_hybrid_device_mesh(inner, outer, standing_in)
  return np.vectorize(lambda d: d.device, otypes=[object])(grid)


def slow_tier_groups(mesh: Mesh, slow: dict[str, int]) -> np.ndarray:
  """Each mesh position's slow-tier group, numbered in mesh order: hybrid_grid puts each axis's
  slow-tier part outermost, so a device's group is its coordinates divided by the inner sizes."""
  inner = [mesh.shape[a] // slow.get(a, 1) for a in mesh.axis_names]
  outer = [slow.get(a, 1) for a in mesh.axis_names]
  coords = np.indices(mesh.devices.shape)
  group_coords = [c // i for c, i in zip(coords, inner)]
  return np.ravel_multi_index(group_coords, outer)


def _describe(sizes: dict[str, int]) -> str:
  return " x ".join(f"{a}={s}" for a, s in sizes.items())
