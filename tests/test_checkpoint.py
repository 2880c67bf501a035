"""Checkpoints resume exactly, restore onto other meshes, and refuse what they cannot trust."""

import shutil

import jax
import numpy as np
import pytest

from helpers import read_metrics, stop_at, tiny_config
from input_pipeline import data
from resilience import fault_tolerance
from run import loop, resume
from run.loop import train
from training.checkpoint import Checkpoints
from training.state import abstract_inputs, plan
from training.step import make_train_step


def config_for(workdir, **overrides):
  """20 steps, logged every step and checkpointed every 10 (test_faults's: 10 steps on data=8, logged and
  checkpointed every 5)."""
  return tiny_config(**{"steps": 20, "log_every": 1, "eval_every": 0, "sample_tokens": 0,
                        "checkpoint.every": 10, "workdir": str(workdir), **overrides})


def losses(workdir):
  return {r["step"]: r["loss"] for r in read_metrics(workdir)}


def restore(workdir, step, **overrides):
  config = config_for(workdir, **overrides)
  layout = plan(config, jax.devices()[:1] if overrides.get("mesh.data") == 1 else None)
  checkpoints = Checkpoints(str(workdir), every=10, keep=3)
  try:
    return layout, config, checkpoints.restore(step, abstract_inputs(layout, config)[0])
  finally:
    checkpoints.close()


RESTORED_STEP = 10
STEPS_AFTER_RESTORE = 3  # the loss of a step after the first depends on the restored Adam moments


def keeping_state_at(step, kept):
  """Checkpoints that also put a host copy of the state handed to them at `step` into `kept`."""

  class KeepingCheckpoints(Checkpoints):
    def save(self, at_step, state, config, **kwargs):
      if at_step == step:
        kept.update(jax.device_get(state))
      super().save(at_step, state, config, **kwargs)

  return KeepingCheckpoints


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """20 steps in one go on data=8, and its state at step 10 as the training loop handed it to be saved."""
  workdir, state_at_10 = tmp_path_factory.mktemp("straight"), {}
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(fault_tolerance, "Checkpoints", keeping_state_at(RESTORED_STEP, state_at_10))
    train(config_for(workdir, **{"mesh.data": 8}))
  return workdir, state_at_10


@pytest.fixture(scope="module")
def straight(straight_run):
  """The workdir of the run every other test compares against."""
  return straight_run[0]


def test_stop_and_resume_is_bit_identical(straight, tmp_path, monkeypatch):
  with monkeypatch.context() as patch:
    patch.setattr(loop, "StopRequests", stop_at(10))
    train(config_for(tmp_path, **{"mesh.data": 8}))
  assert max(losses(tmp_path)) == 10
  train(config_for(tmp_path, **{"mesh.data": 8}))
  assert losses(tmp_path) == losses(straight)
  _, _, resumed = restore(tmp_path, 20, **{"mesh.data": 8})
  _, _, uninterrupted = restore(straight, 20, **{"mesh.data": 8})
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("target", [
    {"mesh.data": 4, "mesh.tensor": 2},
    {"mesh.data": 8, "sharding.zero": 3},
    {"mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2, "sharding.zero": 1},
    {"mesh.data": 1},
])
def test_a_checkpoint_restores_onto_another_mesh(straight_run, target):
  straight, state_at_10 = straight_run
  layout, config, state = restore(straight, RESTORED_STEP, **target)
  assert int(state["step"]) == RESTORED_STEP
  # Adam's m, v and step count as they were in memory at the save: resharding moves them, never changes them.
  restored, saved = jax.device_get(state["opt_state"]), state_at_10["opt_state"]
  assert jax.tree.structure(restored) == jax.tree.structure(saved)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  counts = [int(x) for path, x in jax.tree_util.tree_leaves_with_path(restored)
            if "count" in jax.tree_util.keystr(path)]
  assert counts == [RESTORED_STEP] * 2  # Adam's bias correction and the schedule: 10 updates so far
  # The next steps on the new mesh take the straight run's: the first loss checks the params, the later
  # ones the updates that the restored moments made.
  train_step = make_train_step(layout, config)
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  for step in range(RESTORED_STEP, RESTORED_STEP + STEPS_AFTER_RESTORE):
    batch = data.global_batch(split, seed=config.seed, step=step, batch_size=config.batch_size,
                              seq_len=config.model.max_len, sharding=layout.batch_sharding)
    state, metrics = train_step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), losses(straight)[step + 1], rtol=1e-5,
                               err_msg=f"step {step + 1}")


def test_resuming_with_bfloat16_moments_casts_the_saved_ones(straight_run, tmp_path):
  # The checkpoint's bytes are checked as saved (float32), then cast: a changed dtype is not damage.
  straight, state_at_10 = straight_run
  workdir = tmp_path / "run"
  shutil.copytree(straight, workdir)  # restoring step 10 sets step 20 aside
  config = config_for(workdir, **{"mesh.data": 8, "precision.moments": "bfloat16"})
  layout = plan(config)
  checkpoints = Checkpoints(str(workdir), every=10, keep=3)
  try:
    state = resume.restore_good(checkpoints, RESTORED_STEP, abstract_inputs(layout, config)[0])
  finally:
    checkpoints.close()
  moments = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state["opt_state"])
             if "count" not in jax.tree_util.keystr(path)]
  saved = {jax.tree_util.keystr(path): leaf for path, leaf in
           jax.tree_util.tree_leaves_with_path(state_at_10["opt_state"])}
  assert moments and all(leaf.dtype == jax.numpy.bfloat16 for _, leaf in moments)
  for path, leaf in moments:
    expected = np.asarray(saved[jax.tree_util.keystr(path)]).astype(jax.numpy.bfloat16)
    np.testing.assert_array_equal(np.asarray(leaf), expected, err_msg=jax.tree_util.keystr(path))
  for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(state_at_10["params"])):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_a_finished_run_trains_nothing_and_steps_below_its_checkpoint_are_refused(straight, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(straight, workdir)
  assert train(config_for(workdir, **{"mesh.data": 8})) == {}  # step 20 of 20: nothing to train
  assert losses(workdir) == losses(straight)
  with pytest.raises(ValueError, match=r"checkpoint step 20 in .* is past steps=15; raise --config.steps to "
                                       r"train on, or resume from step 10 with --config.resume=10"):
    train(config_for(workdir, **{"mesh.data": 8, "steps": 15}))
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["10", "20"]
