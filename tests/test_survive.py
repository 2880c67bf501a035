"""fault_tolerance=survive: which layouts outlive a lost process, how the mesh shrinks and regrows, and
the state's moves; runs of several processes that lose some are in tests/test_survive_processes.py."""

import contextlib
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from helpers import ROOT, fresh_state, tiny_config
from input_pipeline import data
from parallel.distributed import free_port
from resilience import survive
from resilience.redundancy import survival_problem
from resilience.state_transfer import local_move_suffices, move_state, relocate, share_state
from resilience.survive import Survivor, shrunk_config, spread
from resilience.survive_events import ProcessesRejoined
from resilience.surviving_checkpoints import SurvivingCheckpoints
from training.state import abstract_inputs, plan

TWO_PER_PROCESS = lambda device: device.id // 2  # 8 devices as 4 processes of 2, as tools/launch.py starts them


@pytest.mark.parametrize("layout, lone_leaf", [
    ({"mesh.data": 8}, None),
    ({"mesh.data": 4, "mesh.tensor": 2}, None),  # tensor inside a process, replicas across them
    ({"mesh.data": 8, "sharding.zero": 1}, "opt_state"),
    ({"mesh.data": 8, "sharding.zero": 3}, "params"),
    # hybrid sharding: ZeRO-3 within groups of 4 devices (2 processes), replicated across the groups
    ({"mesh.data": 8, "sharding.zero": 3, "sharding.fsdp_group": 4}, None),
    ({"mesh.data": 2, "mesh.tensor": 4}, None),  # tensor spans processes, but each replica has a copy
    ({"mesh.pipeline": 2, "mesh.tensor": 4}, "params"),  # one copy of each stage's shards
])
def test_a_layout_survives_only_when_every_shard_lives_on_two_processes(layout, lone_leaf):
  problem = survival_problem(plan(tiny_config(**layout)), process_of=TWO_PER_PROCESS)
  if lone_leaf is None:
    assert problem is None
  else:
    assert problem.startswith(lone_leaf + "/") and "only one process holds" in problem


def test_one_process_has_nothing_to_survive_with():
  assert "one process" in survival_problem(plan(tiny_config(**{"mesh.data": 8})))


@pytest.mark.parametrize("before, live, after", [
    ({"mesh.data": 8, "batch_size": 24}, 6, {"data": 6, "grad_accum": 2}),  # 3 rows a device, not 4
    ({"mesh.data": 8, "batch_size": 48}, 6, {"data": 6, "grad_accum": 2}),
    ({"mesh.data": 4, "mesh.tensor": 2, "batch_size": 24, "grad_accum": 2}, 6, {"data": 3, "grad_accum": 4}),
    ({"mesh.data": 8, "batch_size": 32}, 4, {"data": 4, "grad_accum": 2}),
])
def test_the_mesh_shrinks_over_data_and_keeps_the_global_batch(before, live, after):
  config = tiny_config(**before)
  smaller, why = shrunk_config(config, dict(plan(config).mesh.shape), live)
  assert why is None
  assert (smaller.mesh.data, smaller.grad_accum, smaller.batch_size) == (after["data"], after["grad_accum"],
                                                                          config.batch_size)
  assert smaller.mesh.tensor == config.mesh.tensor


def test_a_lost_process_that_took_state_with_it_ends_the_run_in_a_sentence():
  config = tiny_config(**{"mesh.data": 8, "sharding.zero": 3, "batch_size": 24})
  layout = plan(config)
  survivor = Survivor(config, layout, split=None, evaluate=None, eval_due=lambda done: False,
                      compile_steps=lambda layout, config: (None, None))
  with pytest.raises(ValueError) as refusal:
    survivor._relayout(jax.devices()[:6], step=4)
  # Here one process stands in for four: the sentence names why the state cannot be rebuilt.
  assert str(refusal.value) == (
      "a process was lost before step 5 and the run cannot go on over the 6 live devices: the run has one "
      "process, so there is no other process to carry on; run the same command again to resume from the "
      "last checkpoint.")


def test_a_batch_the_survivors_cannot_split_runs_exactly_on_fewer_of_them():
  # 16 rows do not divide over 6 replicas: 4 of them take 4 rows each in 2 micro-batches of 2 (the
  # rows a device held before), spread so that each of the 3 live processes keeps a device. Padding
  # rows would shift a MoE router's statistics and capacity; fewer replicas change nothing.
  config = tiny_config(**{"mesh.data": 8, "batch_size": 16})
  live = [d for d in jax.devices() if TWO_PER_PROCESS(d) != 2]
  smaller, why = shrunk_config(config, dict(plan(config).mesh.shape), 6)
  assert why is None and (smaller.mesh.data, smaller.grad_accum) == (4, 2)
  assert [d.id for d in spread(live, 4, 1, TWO_PER_PROCESS)] == [0, 1, 2, 6]  # by process in turn, kept in mesh order


def test_a_model_parallel_replica_over_processes_is_rebuilt_from_devices_of_every_survivor():
  # data=2 x (pipeline=2 x tensor=2): a replica spans 2 processes. With process 2 lost, one replica
  # of 4 fits on the 6 live devices; whole runs would leave process 3 out, so each process gives one.
  live = [d for d in jax.devices() if TWO_PER_PROCESS(d) != 2]
  assert [d.id for d in spread(live, 1, 4, TWO_PER_PROCESS)] == [0, 2, 6, 1]


def test_survivors_too_few_for_one_replica_are_refused_in_a_sentence():
  config = tiny_config(**{"mesh.data": 2, "mesh.tensor": 4, "batch_size": 16})
  smaller, why = shrunk_config(config, dict(plan(config).mesh.shape), 3)
  assert smaller is None and why == ("3 live devices are fewer than one data-parallel replica's 4 devices "
                                     "(the other mesh axes)")


def test_the_state_moves_onto_the_live_devices_unchanged():
  config = tiny_config(**{"mesh.data": 8, "batch_size": 24})
  state = fresh_state(plan(config), seed=0)
  smaller, _ = shrunk_config(config, {"data": 8, "pipeline": 1, "expert": 1, "sequence": 1, "tensor": 1}, 6)
  layout = plan(smaller, devices=jax.devices()[:6])
  moved = move_state(state, layout)
  assert {d.id for leaf in jax.tree.leaves(moved) for d in leaf.sharding.device_set} == set(range(6))
  for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(moved))):
    np.testing.assert_array_equal(a, b)


def test_hybrid_sharding_regroups_over_the_live_devices_and_back_with_its_values():
  # data=8 in groups of 4 (2 replicas of 4-way ZeRO-3), 6 devices left: groups of 4 no longer fit, so
  # the run goes on as 3 replicas in groups of 2, each shard sent from a live copy, and grows back.
  config = tiny_config(**{"mesh.data": 8, "sharding.zero": 3, "sharding.fsdp_group": 4, "batch_size": 24})
  before = plan(config)
  smaller, why = shrunk_config(config, dict(before.mesh.shape), 6)
  assert why is None and (smaller.mesh.data, smaller.mesh.expert, smaller.sharding.fsdp_group,
                          smaller.grad_accum) == (6, 1, 2, 2)
  after = plan(smaller, devices=jax.devices()[:6])
  assert dict(after.mesh.shape)["expert"] == 2 and not local_move_suffices(before, after, TWO_PER_PROCESS)
  state = fresh_state(before, seed=0)
  expected = jax.tree.leaves(jax.device_get(state))
  regrouped = relocate(state, before, after, jax.devices()[:6])
  grown = relocate(regrouped, after, before, jax.devices())
  for moved, shardings in ((regrouped, after.state_shardings), (grown, before.state_shardings)):
    for leaf, sharding, value in zip(jax.tree.leaves(moved), jax.tree.leaves(shardings), expected):
      assert leaf.sharding == sharding
      np.testing.assert_array_equal(jax.device_get(leaf), value)


def test_plain_data_parallelism_shrinks_without_sending_anything_and_grows_back_by_sending():
  config = tiny_config(**{"mesh.data": 8, "batch_size": 24})
  smaller, _ = shrunk_config(config, dict(plan(config).mesh.shape), 6)
  whole, shrunk = plan(config), plan(smaller, devices=jax.devices()[:6])
  assert local_move_suffices(whole, shrunk, TWO_PER_PROCESS)
  assert not local_move_suffices(shrunk, whole, TWO_PER_PROCESS)  # the returning process holds nothing


@pytest.mark.parametrize("before, shrunk", [({"mesh.data": 8}, {"data": 6, "grad_accum": 2}),
                                            ({"mesh.data": 4, "mesh.tensor": 2}, {"data": 3, "grad_accum": 2})])
def test_a_grown_mesh_gives_the_returning_devices_a_survivors_state(before, shrunk):
  # 8 devices shrink to 6 (a process lost), then all 8 are live again: the mesh grows back to the run's
  # own layout, and the 2 returning devices, which hold nothing, get the survivors' state through one
  # sum over `data` of a holder's copy and zeros.
  config = tiny_config(**before, batch_size=24)
  shape = dict(plan(config).mesh.shape)
  smaller, _ = shrunk_config(config, shape, 6)
  assert (smaller.mesh.data, smaller.grad_accum) == (shrunk["data"], shrunk["grad_accum"])
  survivors = plan(smaller, devices=jax.devices()[:6])
  state = fresh_state(survivors, seed=1)
  grown, why = shrunk_config(config, shape, 8)
  assert why is None and (grown.mesh.data, grown.mesh.tensor, grown.grad_accum) == (
      config.mesh.data, config.mesh.tensor, config.grad_accum)
  shared = share_state(state, plan(grown), holders=jax.devices()[:6])
  for kept, leaf in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(shared)):
    assert {shard.device.id for shard in leaf.addressable_shards} == set(range(8))
    for shard in leaf.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), kept[shard.index])


class NeverStop:
  def requested(self, step, every, devices=None):
    return False


def survived_losses(monkeypatch, live_counts):
  """Four steps of a Survivor started on 8 devices, whose live devices read `live_counts` block by block
  (one process stands in for several: the shrink, the growth and the state sharing are the survivors'
  real code)."""
  config = tiny_config(**{"mesh.data": 8, "batch_size": 24, "steps": 4, "eval_every": 0})
  layout = plan(config)
  counts = iter(live_counts)

  @contextlib.contextmanager
  def live_devices(devices):
    del devices  # every device of the first mesh; here the live ones are the first few
    yield jax.devices()[:next(counts)]

  monkeypatch.setattr(survive, "live_devices", live_devices)
  monkeypatch.setattr(survive, "survival_problem", lambda layout: None)  # one process, standing in for several
  survivor = Survivor(config, layout, data.open_split(config.data, "train", vocab_size=config.model.vocab_size),
                      evaluate=None, eval_due=lambda done: False)
  losses = [float(finished.metrics["loss"]) for finished in survivor.steps(fresh_state(layout, seed=0), 0, NeverStop())]
  return losses, survivor


def test_survivors_grow_back_when_devices_return_and_train_on_unchanged(monkeypatch):
  # 6 devices live from the start: two blocks shrink to data=6 (one lays out, one moves the state);
  # two steps there, then 8 are live: two blocks relay out to data=8 and share the state onto the 2
  # returning devices; the last two steps run there. The losses equal a run that stays on 6 (the same
  # global batch; the reduction order changes with the mesh).
  grown, survivor = survived_losses(monkeypatch, [6, 6, 6, 6, 8, 8, 8, 8])
  assert survivor.layout.mesh.size == 8 and survivor.config.mesh.data == 8
  stayed, _ = survived_losses(monkeypatch, [6] * 6)
  np.testing.assert_allclose(grown, stayed, rtol=1e-5)


def test_a_restarted_process_rejoins_on_the_grown_layout_and_trains_on_from_the_sent_state(monkeypatch):
  # The restarted process's half of a rejoin, in one process standing in for it: it waits in the live
  # processes' step boundary, lays out over the 8 live devices as they do, holds nothing to send, and
  # trains on from the step of the state it receives. The transfer is the survivors' share_state,
  # tested above; here it hands over an uninterrupted run's state after 2 of 4 steps.
  config = tiny_config(**{"mesh.data": 8, "batch_size": 24, "steps": 4, "eval_every": 0})
  layout = plan(config)
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  monkeypatch.setattr(survive, "live_devices", lambda devices: contextlib.nullcontext(jax.devices()))
  monkeypatch.setattr(survive, "survival_problem", lambda layout: None)  # one process, standing in for several
  uninterrupted = list(Survivor(config, layout, split, evaluate=None, eval_due=lambda done: False)
                       .steps(fresh_state(layout, seed=0), 0, NeverStop()))
  asked = []

  def sent_by_a_live_replica(state, layout, holders):
    asked.append(tuple(holders))
    return uninterrupted[1].state

  monkeypatch.setattr(survive, "share_state", sent_by_a_live_replica)
  joining = Survivor(config, layout, split, evaluate=None, eval_due=lambda done: False, joining=True)
  assert joining.compiled is None  # nothing compiled for the layout it will never run
  state, rejoined = joining.rejoin(abstract_inputs(layout, config)[0])
  assert asked == [()] and joining.layout.mesh.size == 8 and joining.config.grad_accum == 1
  finished = list(joining.steps(state, int(state["step"]), NeverStop(), rejoined))
  assert [f.step for f in finished] == [3, 4] and finished[1].events == ()
  assert [(type(e), e.processes) for e in finished[0].events] == [(ProcessesRejoined, (0,))]
  np.testing.assert_array_equal([float(f.metrics["loss"]) for f in finished],
                                [float(f.metrics["loss"]) for f in uninterrupted[2:]])


def test_only_a_process_started_again_finds_the_run_in_progress(tmp_path):
  # Two processes start together and neither is joining; process 1, SIGKILLed and started again,
  # finds the mark process 0 set in the coordination service, and on the CPU leaves in one sentence.
  script = tmp_path / "start.py"
  script.write_text(
      "import sys, time\n"
      "from ml_collections import ConfigDict\n"
      "from parallel import distributed\n"
      "from resilience.rejoin import joining_run, refuse_on_cpu\n"
      "config = ConfigDict(dict(initialize='yes', coordinator=sys.argv[1], num_processes=2,\n"
      "                         process_id=int(sys.argv[2]), heartbeat_seconds=5))\n"
      "distributed.initialize(config, survive=True)\n"
      "if not joining_run():\n"
      "  print('starting', flush=True)\n"
      "  time.sleep(float(sys.argv[3]))\n"
      "else:\n"
      "  refuse_on_cpu()\n")
  coordinator = f"localhost:{free_port()}"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")

  def start(process, seconds):
    return subprocess.Popen([sys.executable, str(script), coordinator, str(process), str(seconds)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  first, second = start(0, 40), start(1, 600)
  assert second.stdout.readline().strip() == "starting"
  second.kill()
  second.wait()
  again = start(1, 0)
  try:
    assert again.communicate(timeout=60)[1].strip().splitlines()[-1] == (
        "ValueError: process 1 was started again into a run in progress, but rejoining needs GPUs: on the CPU, "
        "gloo refuses a restarted process's collectives, so the run carries on without it.")
    assert first.stdout.readline().strip() == "starting"
  finally:
    for process in (first, second, again):
      process.kill()
      process.wait()


def test_a_shard_no_live_device_holds_is_refused_in_a_sentence():
  # ZeRO-3 over all 8 devices, 2 of them lost: their shards have no other copy.
  layout = plan(tiny_config(**{"mesh.data": 8, "sharding.zero": 3}))
  with pytest.raises(ValueError, match=r"^a shard of a state leaf of shape .* has no copy on the live devices"):
    share_state(fresh_state(layout, seed=0), layout, holders=jax.devices()[:6])


def test_a_peer_late_by_more_than_a_heartbeat_is_waited_for_not_abandoned(tmp_path):
  # A live process that reaches a collective late (descheduled on a loaded host: the suite's own load
  # once starved a relayout's transfer past the heartbeat) must not fail the run, since no process
  # was lost. Heartbeat 2 s; process 1 arrives 3 s late; a collective waiting one heartbeat fails both.
  script = tmp_path / "late.py"
  script.write_text(
      "import sys, time\n"
      "from ml_collections import ConfigDict\n"
      "from parallel import distributed\n"
      "config = ConfigDict(dict(initialize='yes', coordinator=sys.argv[1], num_processes=2,\n"
      "                         process_id=int(sys.argv[2]), heartbeat_seconds=2))\n"
      "distributed.initialize(config, survive=True)\n"
      "import jax, numpy as np\n"
      "from jax.experimental.multihost_utils import live_devices\n"
      "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
      "mesh = Mesh(np.array(jax.devices()), ('all',))\n"
      "total = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))\n"
      "ones = jax.make_array_from_single_device_arrays((jax.device_count(), 3), NamedSharding(mesh, P('all')),\n"
      "    [jax.device_put(np.ones((1, 3), np.float32), d) for d in jax.local_devices()])\n"
      "with live_devices(jax.devices()):\n"
      "  jax.block_until_ready(total(ones))  # connected and compiled\n"
      "with live_devices(jax.devices()):\n"
      "  time.sleep(3.0 * jax.process_index())\n"
      "  print(int(total(ones)[0]), flush=True)\n")
  coordinator = f"localhost:{free_port()}"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  processes = [subprocess.Popen([sys.executable, str(script), coordinator, str(process)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for process in (0, 1)]
  try:
    outputs = [process.communicate(timeout=120) for process in processes]
  finally:
    for process in processes:
      process.kill()
  # The sum of ones over the 4 devices, on both: gloo prints its connections first.
  assert [out.splitlines()[-1:] for out, _ in outputs] == [["4"], ["4"]], [err[-1500:] for _, err in outputs]


def test_a_second_loss_before_the_new_layouts_first_copy_rolls_back_to_the_copy_before(monkeypatch):
  # After a relayout the new layout keeps its first peer copy K steps later; a loss before then used to
  # end the run although the copy kept on the layout before still held every shard.
  config = tiny_config(**{"mesh.data": 8, "sharding.zero": 3, "batch_size": 24})
  survivor = Survivor(config, plan(config), split=None, evaluate=None, eval_due=lambda done: False,
                      compile_steps=lambda layout, config: (None, None))
  monkeypatch.setattr(survive, "processes_of", lambda layout: {0, 1, 3})  # one process stands in for three
  monkeypatch.setattr(survive, "lost_shard", lambda layout, live: "params/blocks/attn/out_bias")
  survivor.copies = types.SimpleNamespace(kept=None)  # the new layout's, none kept yet
  assert survivor._unrecoverable(jax.devices()[:4]).endswith("and no peer copy had been kept yet")
  older = types.SimpleNamespace(step=2, missing=lambda live_processes: None)
  survivor._older_copy = older
  assert survivor._unrecoverable(jax.devices()[:4]) is None and survivor._last_copy() is older
  # Where the older copy lost a shard too, its own sentence says which.
  survivor._older_copy = types.SimpleNamespace(step=2, missing=lambda live_processes: "shard [0:2] was lost")
  assert survivor._unrecoverable(jax.devices()[:4]) == "shard [0:2] was lost"


def test_a_save_in_flight_when_the_processes_change_is_abandoned_in_a_line(tmp_path):
  # Orbax's thread finishing that save waits at the lost processes' barrier: the survivor's exit waits too.
  said = []
  checkpoints = SurvivingCheckpoints(str(tmp_path), joining=False, log=said.append, every=2, keep=None)
  checkpoints._manager = types.SimpleNamespace(is_saving_in_progress=lambda: True, latest_step=lambda: 2)
  checkpoints.reopen_for({0}, step=3)
  assert said == ["the save of step 2 was in flight when the processes changed; it is abandoned, and this "
                  "process may wait up to orbax's 20-minute barrier as it exits."]
  checkpoints.close()
