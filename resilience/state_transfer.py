"""The run's state laid out on another mesh over the live devices (fault_tolerance=survive), exactly.

Where every process already holds the shards its devices need on the new mesh (a data-parallel
shrink keeps whole replicas), the state moves device to device inside each process, with no
communication (`move_state`). Otherwise (a restarted process holds nothing; hybrid sharding
regroups its shards into smaller groups; peer copies rebuild a lost process's shards) one
program per leaf runs over the new mesh: one copy of each shard goes in, placed in a zero leaf
built in host memory, zeros everywhere else, and a sum over every device hands each its new
shard (`assemble`). A sum of one copy and zeros is the copy itself, so the values arrive
unchanged (a -0.0 reads back as 0.0). The programs are compiled before the transfer's block
(`compile_transfer`), and the whole leaf passes through each device once, one leaf at a time: a
recovery costs the largest leaf in transient memory, never the whole state.
"""

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resilience.redundancy import shard_key
from training.state import Layout

_ALL = "all"  # the one axis of the mesh the shares are summed over


def relocate(state, before: Layout, after: Layout, live) -> dict:
  """`state`, laid out on `before`'s mesh, on `after`'s (over some of the `live` devices); the same
  call on every live process."""
  if local_move_suffices(before, after):
    return move_state(state, after)
  return share_state(state, after, holders=set(before.mesh.devices.flat) & set(live))


def local_move_suffices(before: Layout, after: Layout, process_of=lambda device: device.process_index) -> bool:
  """Whether each device of `after` finds its shard of every leaf on its own process under `before`.

  Decided from the shardings alone, so every process reaches the same answer. `process_of` maps a
  device to the process that hosts it (tests pretend several processes).
  """
  for old, new, leaf in zip(jax.tree.leaves(before.state_shardings), jax.tree.leaves(after.state_shardings),
                            jax.tree.leaves(after.abstract_state)):
    shape = tuple(leaf.shape)
    held: dict[int, set] = {}
    for device, index in old.devices_indices_map(shape).items():
      held.setdefault(process_of(device), set()).add(shard_key(index, shape))
    if any(shard_key(index, shape) not in held.get(process_of(device), ())
           for device, index in new.devices_indices_map(shape).items()):
      return False
  return True


def move_state(state, layout: Layout) -> dict:
  """`state` laid out on `layout`'s mesh, built from the shards this process already holds."""

  def move(leaf, sharding):
    held = {shard_key(shard.index, leaf.shape): shard.data for shard in leaf.addressable_shards}
    wanted = sharding.addressable_devices_indices_map(leaf.shape)
    pieces = [jax.device_put(held[shard_key(index, leaf.shape)], device) for device, index in wanted.items()]
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, pieces)

  return jax.tree.map(move, state, layout.state_shardings)


def share_state(state, layout: Layout, holders) -> dict:
  """`state` on `layout`'s mesh, where only the devices in `holders` hold it.

  `state` is this process's state on its old mesh or, on a process that holds none, its abstract
  shapes. Each shard is taken from the first holder (by device id) whose process has a device on the
  new mesh, and put in there.
  """
  entry = {}  # process -> its first device on the new mesh, where what it sends goes in
  for device in layout.mesh.devices.flat:
    entry.setdefault(device.process_index, device)
  sources = {device for device in holders if device.process_index in entry}

  def share(leaf, sharding):
    shape = tuple(leaf.shape)
    held = {shard.device: shard for shard in getattr(leaf, "addressable_shards", ())}
    first_holder = {}
    if held:  # a process that holds nothing sends only zeros, and need not know who sends what
      placed = {device: shard_key(index, shape) for device, index in leaf.sharding.devices_indices_map(shape).items()}
      for device, key in placed.items():
        if device in sources:
          first_holder[key] = min(first_holder.get(key, device), device, key=lambda d: d.id)
      if set(placed.values()) - first_holder.keys():
        raise ValueError(f"a shard of a state leaf of shape {shape} has no copy on the live devices, "
                         "so the state cannot be rebuilt; resume from the last checkpoint.")
    pieces: dict = {}
    for device, shard in held.items():
      if first_holder.get(shard_key(shard.index, shape)) == device:
        at = device if device in set(sharding.mesh.devices.flat) else entry[device.process_index]
        pieces.setdefault(at, []).append((shard.index, shard.data))
    return assemble(pieces, shape, leaf.dtype, sharding)

  return jax.tree.map(share, state, layout.state_shardings)


def assemble(pieces: dict, shape: tuple, dtype, sharding: NamedSharding) -> jax.Array:
  """A leaf laid out by `sharding`, from the pieces the processes put in: `pieces` maps each of this
  process's devices on the sharding's mesh to the (index, value) pairs it contributes, and across all
  processes every part of the leaf is put in exactly once. The same call on every process of the mesh."""
  line = _line(sharding)
  devices = list(line.devices.flat)

  def put_in(device):
    # Built in host memory: a device-side update would compile a program per piece, inside the
    # block whose collectives the other processes are already waiting in.
    share = np.zeros((1, *shape), dtype)
    for index, value in pieces.get(device, ()):
      share[(0, *index)] = np.asarray(value)
    return jax.device_put(share, device)

  shares = jax.make_array_from_single_device_arrays(
      (len(devices), *shape), NamedSharding(line, P(_ALL)), [put_in(device) for device in line.local_devices])
  return _summed(sharding, shape, np.dtype(dtype))(shares)


def compile_transfer(layout: Layout) -> None:
  """Compiles ahead the sums that move `layout`'s state leaves onto it, so that a transfer runs no
  compiler between its collectives: a process compiling there would keep the others waiting, and a
  wait past the collectives' patience (parallel/distributed.py) fails the run."""
  for abstract, sharding in zip(jax.tree.leaves(layout.abstract_state), jax.tree.leaves(layout.state_shardings)):
    _summed(sharding, tuple(abstract.shape), np.dtype(abstract.dtype))


def _line(sharding: NamedSharding) -> Mesh:
  return Mesh(np.asarray(list(sharding.mesh.devices.flat)), (_ALL,))


@functools.cache  # one program per sharding and leaf shape, compiled once
def _summed(sharding: NamedSharding, shape: tuple, dtype: np.dtype):
  """Each device of the sharding's mesh hands in its share of a leaf, and gets its shard of the sum."""
  line = _line(sharding)
  summed = jax.jit(lambda shares: shares.sum(axis=0, dtype=dtype), out_shardings=sharding)
  return summed.lower(jax.ShapeDtypeStruct((line.size, *shape), dtype, sharding=NamedSharding(line, P(_ALL)))).compile()
