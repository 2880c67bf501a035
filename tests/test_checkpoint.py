"""Checkpoints resume exactly, restore onto other meshes, and refuse what they cannot trust."""

import json

import jax
import numpy as np
import pytest

from conftest import tiny_config
from training import data
from training.checkpoint import Checkpoints
from training.dry_run import abstract_inputs
from training import loop
from training.loop import train
from training.preemption import StopRequests
from training.state import plan
from training.step import make_train_step


def config_for(workdir, **overrides):
  return tiny_config(**{"steps": 20, "log_every": 1, "eval_every": 0, "sample_tokens": 0,
                        "checkpoint.every": 10, "workdir": str(workdir), **overrides})


def losses(workdir):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def restore(workdir, step, **overrides):
  config = config_for(workdir, **overrides)
  layout = plan(config, jax.devices()[:1] if overrides.get("mesh.data") == 1 else None)
  checkpoints = Checkpoints(str(workdir), every=10, keep=3)
  try:
    return layout, config, checkpoints.restore(step, abstract_inputs(layout, config)[0])
  finally:
    checkpoints.close()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """20 steps in one go on data=8: the run every other test compares against."""
  workdir = tmp_path_factory.mktemp("straight")
  train(config_for(workdir, **{"mesh.data": 8}))
  return workdir


class StopAtStep10(StopRequests):
  """A preemption that arrives during step 10, as SIGTERM would."""

  def requested(self, step, every):
    self.signal_name = "SIGTERM" if step == 10 else None
    return step == 10


def test_stop_and_resume_is_bit_identical(straight, tmp_path, monkeypatch):
  with monkeypatch.context() as patch:
    patch.setattr(loop, "StopRequests", StopAtStep10)
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
def test_a_checkpoint_restores_onto_another_mesh(straight, target):
  layout, config, state = restore(straight, 10, **target)
  assert int(state["step"]) == 10
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=config.seed, step=10, batch_size=config.batch_size,
                            seq_len=config.model.max_len, sharding=layout.batch_sharding)
  _, metrics = make_train_step(layout, config)(state, batch)
  np.testing.assert_allclose(float(metrics["loss"]), losses(straight)[11], rtol=1e-5)
