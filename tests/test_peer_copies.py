"""Peer copies in host memory: which shards travel where, and the state rebuilt from live shards and
copies onto the survivors' smaller mesh, exactly (one process pretends to be four of two devices)."""

import jax
import numpy as np
import pytest

from helpers import tiny_config
from resilience.peer_copies import CopyPlan, PeerCopies
from resilience.survive import replica_shape, spread
from training.state import init_state, plan

TWO_PER_PROCESS = lambda device: device.id // 2  # 8 devices as 4 processes of 2, as tools/launch.py starts them


def kept_copy(config, step=2):
  """A copy of a fresh state kept after step `step` (each leaf offset, so no two leaves are alike)."""
  layout = plan(config)
  state = jax.tree.map(lambda leaf: leaf + 1, init_state(layout, seed=0))
  copies = PeerCopies(layout, every=2, process_of=TWO_PER_PROCESS)
  copies.after_step(state, step)  # sent after the step
  copies.before_step()  # arrives during the next one
  kept = copies.block_done()  # and counts once that block succeeded everywhere
  return layout, state, kept


def test_each_lone_shard_travels_once_to_the_next_process_in_the_ring():
  layout = plan(tiny_config(**{"mesh.data": 8, "sharding.zero": 3}))
  copies = CopyPlan(layout, TWO_PER_PROCESS)
  assert copies.next_in_ring == {0: 1, 1: 2, 2: 3, 3: 0}
  leaf = copies.leaves[[l.name for l in copies.leaves].index("params/embed/tokens")]
  # Each device's shard goes to the device in the same place on the next process, in one permute.
  assert len(leaf.keeper) == 8 and len(leaf.rounds) == 1
  assert set(leaf.rounds[0]) == {(0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 7), (6, 0), (7, 1)}
  # A leaf ZeRO-3 shards lives once over the processes, so a copy sends it once; one too small to
  # shard is on every process, and sends nothing.
  copied = {l.name for l in copies.leaves if l.keeper}
  assert "params/blocks/attn/qkv_bias" not in copied
  leaves = dict(zip([l.name for l in copies.leaves], jax.tree.leaves(layout.abstract_state)))
  assert copies.bytes_sent(layout) == sum(leaves[name].size * leaves[name].dtype.itemsize for name in copied)


def test_a_replicated_layout_has_nothing_to_copy():
  layout = plan(tiny_config(**{"mesh.data": 8}))
  assert CopyPlan(layout, TWO_PER_PROCESS).bytes_sent(layout) == 0


@pytest.mark.parametrize("overrides", [{"mesh.data": 8, "sharding.zero": 3},
                                       {"mesh.data": 2, "mesh.pipeline": 2, "mesh.tensor": 2, "sharding.zero": 1}])
def test_the_state_is_rebuilt_from_live_shards_and_the_lost_processs_copies(overrides):
  config = tiny_config(**overrides, batch_size=16)
  layout, state, kept = kept_copy(config)
  assert kept.step == 2
  # Process 2 is lost: its lone shards come from process 3's copy; the rest from the survivors' own.
  survivors = tiny_config(**{**overrides, "mesh.data": overrides["mesh.data"] // 2}, batch_size=16)
  live = [d for d in jax.devices() if TWO_PER_PROCESS(d) != 2]
  replicas, per_replica = replica_shape(dict(survivors.mesh), group=0)
  smaller = plan(survivors, devices=spread(live, replicas, per_replica, TWO_PER_PROCESS))  # as the survivors do
  assert kept.missing({0, 1, 3}) is None
  rebuilt = kept.restore(smaller, {0, 1, 3}, hosted=lambda process: process != 2)
  for before, after, sharding in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(rebuilt),
                                     jax.tree.leaves(smaller.state_shardings)):
    assert after.sharding == sharding
    np.testing.assert_array_equal(jax.device_get(after), before)


def test_a_shard_and_its_copy_lost_together_are_named_in_a_sentence():
  _, _, kept = kept_copy(tiny_config(**{"mesh.data": 8, "sharding.zero": 3}))
  # Process 3 keeps process 2's copy: losing both loses process 2's shards of every leaf.
  assert kept.missing({0, 1}) == ("params/blocks/attn/out_bias shard [0:2, 32:40] was held only by process 2 and "
                                  "its peer copy by process 3, all lost")
