"""Warmup-stable-decay (schedule.decay=wsd) and branching a run from another's checkpoint (branch_from).

A WSD run's steps before its decay are the same whatever its budget, so a long stable run's checkpoint at
step S decays into a budget of S + decay_steps: the branch must equal the run that had that budget from
the start, on one CPU bit for bit (the same programs on the same batches: data is a function of the step).
"""

import jax
import numpy as np
import pytest

from helpers import read_metrics, tiny_config
from run.loop import train
from training.checkpoint import Checkpoints
from training.optimizer import learning_rate
from training.state import abstract_inputs, plan

DECAY = 4


def wsd(workdir, steps, **overrides):
  return tiny_config(**{"steps": steps, "log_every": 1, "eval_every": 0, "sample_tokens": 0,
                        "checkpoint.every": 8, "workdir": str(workdir), "schedule.decay": "wsd",
                        "schedule.warmup_steps": 2, "schedule.decay_steps": DECAY, "mesh.data": 8, **overrides})


def test_wsd_is_stable_until_its_decay_then_linear_to_the_final_rate():
  short, long = (learning_rate(wsd("unused", steps)) for steps in (12, 40))
  peak, final = 3e-3, 3e-4  # tiny's lr, and final_lr_ratio 0.1 of it
  np.testing.assert_allclose([short(s) for s in range(13)],
                             [0, peak / 2, *[peak] * 7, peak - (peak - final) / 4, peak - (peak - final) / 2,
                              peak - 3 * (peak - final) / 4, final], rtol=1e-6)
  assert all(short(s) == long(s) for s in range(12 - DECAY + 1))  # the budget changes nothing before the decay


def final_params(workdir, config):
  layout = plan(config)
  checkpoints = Checkpoints(str(workdir), every=0, keep=None)
  try:
    return jax.device_get(checkpoints.restore(config.steps, abstract_inputs(layout, config)[0])["params"])
  finally:
    checkpoints.close()


def test_a_decay_branched_from_a_stable_checkpoint_equals_the_run_with_that_budget(tmp_path):
  straight = wsd(tmp_path / "budget_12", 12)
  train(straight)
  stable = wsd(tmp_path / "stable", 16)  # stable through step 12: its checkpoint at 8 is a budget of 12's
  train(stable)
  branch = wsd(tmp_path / "decayed_at_8", 12, branch_from=f"{tmp_path / 'stable'}:8")
  train(branch)
  losses = lambda run: {r["step"]: r["loss"] for r in read_metrics(run.workdir)}
  assert losses(branch) == {s: loss for s, loss in losses(straight).items() if s > 8}
  assert losses(stable)[12] != losses(straight)[12]  # the budgets part at step 9
  expected, actual = final_params(straight.workdir, straight), final_params(branch.workdir, branch)
  assert all(np.array_equal(a, e) for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)))
  source = Checkpoints(stable.workdir, every=0, keep=None)
  assert source.steps() == [8, 16]  # the source is left as it was
  source.close()


@pytest.mark.parametrize("overrides, says", [
    ({"branch_from": "runs/stable"}, r"^branch_from='runs/stable' is not <workdir>:<step>; e.g. runs/stable:800\.$"),
    ({"branch_from": "{missing}:8"}, r"holds no checkpoints; name a run's workdir\.$"),
    ({"branch_from": "{own}:8"}, r"names this run's own workdir; resume it with --config.resume=8"),
    ({"schedule.decay_steps": 0}, r"^schedule.decay_steps=0 must be at least 1 and at most steps - warmup_steps = 10 "
                                  r"under schedule.decay='wsd'"),
    ({"schedule.decay_steps": 11}, r"^schedule.decay_steps=11 must be at least 1 and at most"),
])
def test_bad_branches_and_decays_are_refused_before_anything_is_written(tmp_path, overrides, says):
  run = tmp_path / "run"
  fields = {k: v.format(missing=tmp_path / "missing", own=run) for k, v in overrides.items() if isinstance(v, str)}
  with pytest.raises(ValueError, match=says) as raised:
    train(wsd(run, 12, **{**overrides, **fields}))
  assert "\n" not in str(raised.value)
  assert not run.exists()
