"""Rejoin (fault_tolerance=survive): the mesh grows back, and devices that hold no state get a live replica's.

When the live devices outnumber the mesh (a restarted process is back), the run is laid out again
from its own config over all of them, and the state is shared in one compiled program over the
grown mesh: each device puts in the shard its process already holds, or zeros where it holds
none, and a sum over `data` of one holder's copy gives every replica that copy. A sum of one copy
and zeros is the copy itself, so the newcomers' state equals the survivors' value for value
(a -0.0 reads back as 0.0); nothing is read from disk. Survive mode only accepts layouts whose
every leaf is whole on each data-parallel replica (parallel/redundancy.py), which this relies on.

A restarted process learns that it is rejoining from the coordination service, which process 0
hosts and which outlives every other process: process 0 marks the run as started once all the
processes that started it together have looked for the mark, so only a later start finds it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import distributed as jax_distributed
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from parallel.mesh import DATA
from parallel.redundancy import shard_key
from training.state import Layout

_STARTED = "meshlm/run_started"  # the coordination service's key: set, the run is in progress
_START_TIMEOUT_MS = 10 * 60 * 1000  # the processes of one start may be launched minutes apart


def joining_run() -> bool:
  """Whether this process is restarting into a run in progress (fault_tolerance=survive, several processes).

  Every process that starts the run together waits at one barrier after looking for the mark, and
  only then does process 0 set it: none of them can see it, and a process started again later does.
  """
  client = jax_distributed.global_state.client  # as JAX's fault tolerance guide reaches it
  try:
    client.key_value_try_get(_STARTED)
    return True
  except jax.errors.JaxRuntimeError as missing:
    if "NOT_FOUND" not in str(missing):
      raise
  client.wait_at_barrier("meshlm/looked_for_run", _START_TIMEOUT_MS)
  if jax.process_index() == 0:
    client.key_value_set(_STARTED, "1")
  return False


def refuse_on_cpu() -> None:
  """Ends a joining process on the CPU, where gloo cannot take it back, before the live ones wait for it.

  The restarted process's first collective fails (ALREADY_EXISTS: its first life's gloo rendezvous
  keys are still in the coordination service), and its failure takes the live processes down with
  it; leaving at once keeps their run going.
  """
  if jax.default_backend() != "cpu":
    return
  jax.distributed.shutdown()  # out of the live processes' next barrier now, not a heartbeat later
  raise ValueError(f"process {jax.process_index()} was started again into a run in progress, but rejoining "
                   "needs GPUs: on the CPU, gloo refuses a restarted process's collectives, so the run "
                   "carries on without it.")


def share_state(state, layout: Layout, holders) -> dict:
  """`state` on `layout`'s mesh, where only the devices in `holders` hold it.

  `state` is this process's state on its old mesh (any arrays it holds) or, on a process that
  holds none, its abstract shapes; a device of `layout`'s mesh outside `holders` contributes zeros.
  """
  mesh, holders = layout.mesh, set(holders)
  for path, sharding in jax.tree_util.tree_leaves_with_path(layout.state_shardings):
    if DATA in jax.tree.leaves(tuple(sharding.spec)):
      raise ValueError(f"state leaf {jax.tree_util.keystr(path)} is split over `data`, so no replica holds "
                       "all of it to share; rejoining needs every leaf whole on each data-parallel replica.")

  def local(leaf, sharding):
    held = {shard_key(shard.index, leaf.shape): shard.data
            for shard in getattr(leaf, "addressable_shards", ())}
    pieces = []
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
      piece = (held[shard_key(index, leaf.shape)] if device in holders
               else np.zeros(sharding.shard_shape(leaf.shape), leaf.dtype))
      pieces.append(jax.device_put(piece, device))
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, pieces)

  flags_sharding = NamedSharding(mesh, P(DATA))
  flags = jax.make_array_from_single_device_arrays(
      (mesh.shape[DATA],), flags_sharding,
      [jax.device_put(np.array([device in holders], np.int32), device)
       for device in flags_sharding.addressable_devices_indices_map((mesh.shape[DATA],))])
  leaves, tree = jax.tree.flatten(jax.tree.map(local, state, layout.state_shardings))
  specs = [sharding.spec for sharding in jax.tree.leaves(layout.state_shardings)]

  def from_first_holder(flag, *local_leaves):
    source = jnp.argmax(jax.lax.all_gather(flag[0], DATA))  # the first replica that holds the state
    mine = jax.lax.axis_index(DATA) == source
    return tuple(jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), DATA) for x in local_leaves)

  shared = jax.jit(jax.shard_map(from_first_holder, mesh=mesh, in_specs=(P(DATA), *specs),
                                 out_specs=tuple(specs)))(flags, *leaves)
  return jax.tree.unflatten(tree, shared)
