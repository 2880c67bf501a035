"""The five-axis device mesh, built from `config.mesh`."""

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# Outermost (slowest links) to innermost (fastest): tensor parallelism wants
# NVLink/ICI neighbours, pipeline stages tolerate slow links.
DATA, PIPELINE, EXPERT, SEQUENCE, TENSOR = "data", "pipeline", "expert", "sequence", "tensor"
AXES = (DATA, PIPELINE, EXPERT, SEQUENCE, TENSOR)


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


def make_mesh(mesh_config, devices=None, fsdp_group: int = 0) -> Mesh:
  """A mesh over `devices` (all by default) with every axis in Auto mode; `fsdp_group` as hybrid_shape.

  Auto rather than Explicit: shardings come from the logical rules as
  constraints and GSPMD propagates the rest, the way MaxText runs by default;
  Explicit would make every contraction over a sharded dimension spell out its
  output sharding inside the model, which must stay mesh-agnostic.
  """
  devices = jax.devices() if devices is None else devices
  shape = hybrid_shape(mesh_shape(mesh_config, len(devices)), fsdp_group)
  axis_types = (AxisType.Auto,) * len(AXES)
  if len(devices) == jax.device_count():
    return jax.make_mesh(tuple(shape[a] for a in AXES), AXES, axis_types=axis_types, devices=devices)
  device_grid = np.asarray(devices).reshape(tuple(shape[a] for a in AXES))
  return Mesh(device_grid, AXES, axis_types=axis_types)


def _describe(sizes: dict[str, int]) -> str:
  return " x ".join(f"{a}={s}" for a, s in sizes.items())
