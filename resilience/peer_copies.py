"""Peer copies in host memory (fault_tolerance=survive with peer_copy_every=K): what lets a run whose
state has shards on one process only (ZeRO-1/3 over processes, tensor or pipeline across them)
survive losing that process, with no file read.

Every K steps each process keeps in its host memory the distinct shards its devices hold at that
step (its own snapshot) and the shards that only the process before it, in a ring over the run's
processes, holds (the peer copy). Those travel once, device to device, in collective-permutes
dispatched after the step and waited for during the next one; both reach host memory on a
background thread. A copy counts once the block of the step after it has succeeded on every live
process, so every survivor agrees on the last whole one. When a process is lost, the survivors
roll the whole state back to that step, each shard from the snapshot of a live process that held
it or else from the peer copy of the lost process's shards, and redo the steps since: at most K,
equal to the first time round (batch `s` is a pure function of (seed, s)).
"""

import dataclasses
import threading

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resilience.redundancy import shard_key
from resilience.state_transfer import assemble
from training.state import Layout

_ALL = "all"  # the one axis of the line of devices the copies travel along


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """Who holds each shard of one state leaf under a layout, and how its lone shards are copied."""
  name: str  # 'params/...', for a refusal
  holders: dict  # shard key -> the processes whose devices hold it
  keeper: dict  # lone shard key -> the process that keeps its copy: the next one in the ring
  rounds: tuple  # per collective-permute: ((source, target) positions on the line, ...)
  received: dict  # (round, target position) -> the shard key that arrives there


class CopyPlan:
  """The copies under one layout, decided from its shardings alone: the same on every process."""

  def __init__(self, layout: Layout, process_of=lambda device: device.process_index):
    """`process_of` maps a device to the process that hosts it (tests pretend several processes)."""
    self.process_of = process_of
    self.devices = list(layout.mesh.devices.flat)
    processes = sorted({process_of(device) for device in self.devices})
    self.next_in_ring = {p: processes[(i + 1) % len(processes)] for i, p in enumerate(processes)}
    local = {p: [d for d in self.devices if process_of(d) == p] for p in processes}
    position = {device: i for i, device in enumerate(self.devices)}
    self.leaves = []
    for (path, abstract), sharding in zip(jax.tree_util.tree_leaves_with_path(layout.abstract_state),
                                          jax.tree.leaves(layout.state_shardings)):
      shape = tuple(abstract.shape)
      placed = {device: shard_key(index, shape) for device, index in sharding.devices_indices_map(shape).items()}
      holders: dict = {}
      for device, key in placed.items():
        holders.setdefault(key, set()).add(process_of(device))
      keeper, sends_to = {}, {p: [] for p in processes}
      for key, held_by in holders.items():
        if len(held_by) == 1:
          (owner,) = held_by
          keeper[key] = self.next_in_ring[owner]
          source = min((d for d, k in placed.items() if k == key), key=lambda d: d.id)
          sends_to[keeper[key]].append((source, key))
      rounds, received = [], {}
      for target_process, sends in sends_to.items():
        targets = local[target_process]
        for j, (source, key) in enumerate(sends):  # a device takes one shard per collective-permute
          round_ = j // len(targets)
          while len(rounds) <= round_:
            rounds.append([])
          target = position[targets[j % len(targets)]]
          rounds[round_].append((position[source], target))
          received[(round_, target)] = key
      self.leaves.append(_Leaf(jax.tree_util.keystr(path, simple=True, separator="/"),
                               {k: frozenset(v) for k, v in holders.items()}, keeper,
                               tuple(tuple(r) for r in rounds), received))
    line = Mesh(np.asarray(self.devices), (_ALL,))
    self._line = line
    self._copied = [i for i, leaf in enumerate(self.leaves) if leaf.rounds]  # leaves with lone shards
    every_round = tuple(self.leaves[i].rounds for i in self._copied)
    permute = jax.jit(jax.shard_map(
        lambda shards: [[jax.lax.ppermute(shard, _ALL, perm) for perm in perms]
                        for shard, perms in zip(shards, every_round)],
        mesh=line, in_specs=P(_ALL), out_specs=P(_ALL)))
    # Each leaf's shards side by side along the line, one per device (a lone shard is never a
    # scalar). Compiled now, outside any step: compiling inside the step that sends the first copy
    # would keep the other processes waiting in its collectives, past the collective timeout.
    abstract, shardings = jax.tree.leaves(layout.abstract_state), jax.tree.leaves(layout.state_shardings)
    self._side_by_side = []
    for i in self._copied:
      shard_shape = shardings[i].shard_shape(tuple(abstract[i].shape))
      self._side_by_side.append((len(self.devices) * shard_shape[0], *shard_shape[1:]))
    self._permute = permute.lower([jax.ShapeDtypeStruct(shape, abstract[i].dtype, sharding=NamedSharding(line, P(_ALL)))
                                   for i, shape in zip(self._copied, self._side_by_side)]).compile()

  def bytes_sent(self, layout: Layout) -> int:
    """What one copy sends across processes, in all: every lone shard once."""
    return sum(_shard_bytes(abstract, sharding) * len(leaf.keeper) for leaf, abstract, sharding in
               zip(self.leaves, jax.tree.leaves(layout.abstract_state), jax.tree.leaves(layout.state_shardings)))

  def send(self, state) -> list:
    """Dispatches the collective-permutes of `state`'s lone shards; returns what arrives (on device)."""
    leaves, side_by_side = jax.tree.leaves(state), []
    for i, shape in zip(self._copied, self._side_by_side):
      shard_of = {shard.device: shard.data for shard in leaves[i].addressable_shards}
      side_by_side.append(jax.make_array_from_single_device_arrays(
          shape, NamedSharding(self._line, P(_ALL)), [shard_of[device] for device in self._line.local_devices]))
    arrived = dict(zip(self._copied, self._permute(side_by_side)))
    return [arrived.get(i, []) for i in range(len(self.leaves))]


class Snapshot:
  """The state at one step in this process's host memory: its own distinct shards and the peer copy."""

  def __init__(self, plan: CopyPlan, step: int, state, arrived: list):
    self.plan, self.step = plan, step
    self._own_on_device = [{shard_key(shard.index, leaf.shape): shard.data for shard in leaf.addressable_shards}
                           for leaf in jax.tree.leaves(state)]
    position = {device: i for i, device in enumerate(plan.devices)}
    self._peer_on_device = [
        {leaf.received[(r, position[shard.device])]: shard.data
         for r, out in enumerate(outs) for shard in out.addressable_shards
         if (r, position[shard.device]) in leaf.received}
        for leaf, outs in zip(plan.leaves, arrived)]
    self.own, self.peer = [], []
    self._to_host = None

  def arrived(self) -> None:
    """Waits until the peer copy is on this process's devices (inside a protected block)."""
    jax.block_until_ready(self._peer_on_device)

  def keep(self) -> None:
    """Moves both to host memory on a background thread: the copy counts from here."""
    def to_host():
      self.own = [{k: np.asarray(v) for k, v in leaf.items()} for leaf in self._own_on_device]
      self.peer = [{k: np.asarray(v) for k, v in leaf.items()} for leaf in self._peer_on_device]
      self._own_on_device = self._peer_on_device = None
    # Not a daemon: a process ending mid-copy waits for it rather than tear the runtime down under it.
    self._to_host = threading.Thread(target=to_host, name="meshlm-peer-copy")
    self._to_host.start()

  def host_bytes(self) -> int:
    self._to_host.join()
    return sum(v.nbytes for leaves in (self.own, self.peer) for leaf in leaves for v in leaf.values())

  def missing(self, live_processes: set[int]) -> str | None:
    """Why the state at `step` cannot be rebuilt on `live_processes` (one sentence), or None."""
    for leaf in sorted(self.plan.leaves, key=lambda leaf: not leaf.name.startswith("params")):  # a leaf users know
      for key, held_by in leaf.holders.items():
        if not held_by & live_processes and leaf.keeper.get(key) not in live_processes:
          return (f"{leaf.name} shard {_slices(key)} was held only by process {', '.join(map(str, sorted(held_by)))}"
                  + (f" and its peer copy by process {leaf.keeper[key]}" if key in leaf.keeper else "")
                  + ", all lost")
    return None

  def restore(self, layout: Layout, live_processes: set[int], hosted=lambda process: process == jax.process_index()):
    """The state at `step` laid out on `layout` (over live devices only); the same call on every live
    process, `hosted(process)` telling the processes this one is. Each shard is put in once: by the
    first live process whose devices held it, else by the keeper of its peer copy, on its first
    device of the new mesh."""
    self._to_host.join()
    entry = {}
    for device in layout.mesh.devices.flat:
      entry.setdefault(self.plan.process_of(device), device)
    leaves = []
    for i, (leaf, abstract, sharding) in enumerate(zip(self.plan.leaves, jax.tree.leaves(layout.abstract_state),
                                                       jax.tree.leaves(layout.state_shardings))):
      pieces: dict = {}
      for key, held_by in leaf.holders.items():
        live_holders = held_by & live_processes
        sender = min(live_holders) if live_holders else leaf.keeper[key]
        if hosted(sender):
          value = self.own[i][key] if live_holders else self.peer[i][key]
          pieces.setdefault(entry[sender], []).append((tuple(slice(*pair) for pair in key), value))
      leaves.append(assemble(pieces, tuple(abstract.shape), abstract.dtype, sharding))
    return jax.tree.unflatten(jax.tree.structure(layout.abstract_state), leaves)


class PeerCopies:
  """A surviving run's copies: the one sent after the last step, the one arriving during this
  step's block, and the last one every live process has kept."""

  def __init__(self, layout: Layout, every: int, process_of=lambda device: device.process_index):
    self.every = every
    self.plan = CopyPlan(layout, process_of)
    self._sent: Snapshot | None = None
    self._arriving: Snapshot | None = None
    self.kept: Snapshot | None = None

  def before_step(self) -> None:
    """Inside a step's block, with the step dispatched: waits for the copy sent after the last step."""
    self._arriving, self._sent = self._sent, None
    if self._arriving is not None:
      self._arriving.arrived()

  def after_step(self, state, step: int) -> None:
    """Sends the copy of `state` after step `step` when one is due (inside the step's block)."""
    if step % self.every == 0:
      self._sent = Snapshot(self.plan, step, state, self.plan.send(state))

  def block_done(self) -> Snapshot | None:
    """After a block that succeeded on every live process: the copy that arrived in it is kept (and
    returned)."""
    if self._arriving is None:
      return None
    self.kept, self._arriving = self._arriving, None
    self.kept.keep()
    return self.kept

  def block_failed(self) -> None:
    """After a block that failed: copies not yet kept may be incomplete somewhere, and are dropped."""
    self._sent = self._arriving = None


def _shard_bytes(abstract, sharding) -> int:
  shape = sharding.shard_shape(tuple(abstract.shape))
  return int(np.prod(shape)) * np.dtype(abstract.dtype).itemsize


def _slices(key) -> str:
  return "[" + ", ".join(f"{start}:{stop}" for start, stop in key) + "]"
