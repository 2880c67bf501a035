"""Which processes hold a copy of each piece of the state, and so whether a lost process can be survived.

A layout survives the loss of any one process when every shard of every state leaf also lives on
another process: plain data parallelism replicates everything over `data`, while ZeRO-1/3 over a
`data` axis that spans processes leaves each optimizer (and parameter) shard on one process only.
"""

import jax


def shard_key(index: tuple, shape: tuple) -> tuple:
  """A shard's index (slices) as plain (start, stop) pairs, comparable across shardings."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def lone_shard(shardings, abstract, process_of=lambda device: device.process_index) -> str | None:
  """The first state leaf with a shard held by one process only ('params/...'), or None.

  `process_of` maps a device to the process that hosts it (tests pretend several processes).
  """
  return _first_leaf(shardings, abstract, lambda devices: len({process_of(d) for d in devices}) < 2)


def lost_shard(layout, live) -> str | None:
  """The first state leaf with a shard that no device in `live` holds, or None."""
  live = set(live)
  return _first_leaf(layout.state_shardings, layout.abstract_state, lambda devices: not devices & live)


def _first_leaf(shardings, abstract, short) -> str | None:
  """The name of the first leaf, parameters first (the leaf a user recognises), with a shard whose
  set of holding devices is `short`, or None."""
  named = [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
           for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)]
  leaves = sorted(zip(named, jax.tree.leaves(shardings)), key=lambda item: not item[0][0].startswith("params"))
  for (name, leaf), sharding in leaves:
    holders: dict[tuple, set] = {}
    for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
      holders.setdefault(shard_key(index, leaf.shape), set()).add(device)
    if any(short(devices) for devices in holders.values()):
      return name
  return None


def survival_problem(layout, process_of=lambda device: device.process_index) -> str | None:
  """Why losing a process would lose part of the state (one sentence), or None if it can be survived."""
  processes = {process_of(device) for device in layout.mesh.devices.flat}
  if len(processes) < 2:
    return "the run has one process, so there is no other process to carry on"
  leaf = lone_shard(layout.state_shardings, layout.abstract_state, process_of)
  if leaf is None:
    return None
  return (f"{leaf} has a shard that only one process holds (the state is sharded over processes, "
          f"not replicated: ZeRO or a model axis spans them)")
