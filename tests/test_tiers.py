"""Two network tiers: the hybrid mesh's order, the refusals, and each collective's bytes by tier."""

import json
import os
import subprocess
import sys
from fractions import Fraction

import jax
import numpy as np
import pytest

from helpers import ROOT, assert_params_close, assert_tree_close, run_layout, tiny_config
from measure import analysis, estimate, tiers
from measure.dry_run import busy_slots, compile_partitioned_train_step, model_weights
from parallel.distributed import free_port
from parallel.mesh import make_mesh, slow_tier_groups, slow_tier_shape
from training.state import plan


def test_a_slow_tier_part_of_an_axis_is_outermost():
  config = tiny_config(**{"mesh.data": 4, "mesh.tensor": 2, "mesh.dcn_data": 2})
  mesh = make_mesh(config.mesh)
  ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(4, 2)
  # One process stands for two slices of 4 consecutive devices each: data's first two rows in the first.
  np.testing.assert_array_equal(ids, [[0, 1], [2, 3], [4, 5], [6, 7]])
  groups = slow_tier_groups(mesh, slow_tier_shape(config.mesh, dict(mesh.shape))).reshape(4, 2)
  np.testing.assert_array_equal(groups, [[0, 0], [0, 0], [1, 1], [1, 1]])


def test_training_on_a_mesh_over_two_slices_equals_one_device():
  layout = {"mesh.data": 4, "mesh.tensor": 2, "mesh.dcn_data": 2}
  loss, grads, params = run_layout(layout, jax.devices())
  one_loss, one_grads, one_params = run_layout({"mesh.data": 1}, jax.devices()[:1])
  np.testing.assert_allclose(loss, one_loss, rtol=1e-5)
  assert_tree_close(grads, one_grads, "gradients")
  assert_params_close(params, one_params, "parameters after the steps")


def test_pipeline_stages_over_two_slices_keep_data_inside_each():
  config = tiny_config(**{"mesh.data": 2, "mesh.pipeline": 4, "mesh.dcn_pipeline": 2, "model.num_layers": 4})
  mesh = make_mesh(config.mesh)
  groups = slow_tier_groups(mesh, slow_tier_shape(config.mesh, dict(mesh.shape))).reshape(2, 4)
  np.testing.assert_array_equal(groups, [[0, 0, 1, 1], [0, 0, 1, 1]])
  assert {d.id for d in mesh.devices.reshape(2, 4)[:, :2].flat} == {0, 1, 2, 3}


@pytest.mark.parametrize("flag, says", [
    ("mesh.dcn_tensor", r"^mesh.dcn_tensor=2 would put tensor parallelism's per-layer collectives on the slow "
                        r"network .* so set mesh.dcn_tensor=1\.$"),
    ("mesh.dcn_sequence", r"^mesh.dcn_sequence=2 would put sequence parallelism's"),
    ("mesh.dcn_expert", r"^mesh.dcn_expert=2 would put expert parallelism's"),
])
def test_an_axis_that_must_stay_on_the_fast_links_is_refused(flag, says):
  with pytest.raises(ValueError, match=says):
    plan(tiny_config(**{"mesh.data": 2, "mesh.tensor": 2, "mesh.sequence": 2, flag: 2}))


def test_a_slow_tier_count_that_does_not_divide_its_axis_is_refused():
  with pytest.raises(ValueError, match=r"^mesh.dcn_data=3 does not divide the data axis of 8 devices"):
    plan(tiny_config(**{"mesh.data": 8, "mesh.dcn_data": 3}))


def test_slow_shares_by_hand():
  # data=8 over 2 hosts of 4: the hosts all-reduce a quarter of the buffer, (2-1)/2 of it twice,
  # 2N/8 of the ring's 2N x 7/8.
  assert tiers.slow_share("all-reduce", inside=4, groups=2) == Fraction(1, 7)
  assert tiers.slow_share("all-gather", inside=1, groups=8) == 1  # every member in a slice of its own
  assert tiers.slow_share("all-to-all", inside=4, groups=2) == Fraction(4, 7)  # 4 of the 7 others are away
  assert tiers.slow_share("all-reduce", inside=8, groups=1) == 0
  assert tiers.pipeline_crossing_pairs(stages=8, groups=2, schedule="gpipe") == Fraction(2, 8)
  assert tiers.pipeline_crossing_pairs(stages=8, groups=2, schedule="1f1b") == Fraction(1, 7)


@pytest.mark.parametrize("layout", [
    {"mesh.data": 4, "mesh.tensor": 2, "mesh.dcn_data": 2},
    {"mesh.data": 2, "mesh.pipeline": 4, "mesh.dcn_pipeline": 2, "model.num_layers": 4},
    {"mesh.data": 2, "mesh.pipeline": 4, "mesh.dcn_pipeline": 2, "model.num_layers": 4, "pipeline.schedule": "1f1b"},
], ids=["data over slices", "gpipe stages over slices", "1f1b stages over slices"])
def test_the_estimate_splits_bytes_by_tier_as_the_compiled_replica_groups_do(layout):
  config = tiny_config(**layout)
  trained = plan(config)
  mesh, slow = dict(trained.mesh.shape), slow_tier_shape(config.mesh, dict(trained.mesh.shape))
  compiled, partitioned = compile_partitioned_train_step(trained, config)
  found = analysis.collectives(compiled, trained.mesh, partitioned, busy_slots(config, mesh), slow)
  predicted = tiers.split(estimate.collectives(config, mesh, model_weights(config)), mesh, slow,
                          config.pipeline.schedule)
  sent = analysis.tier_traffic_per_step(found)
  assert any(t[tiers.SLOW] for t in sent.values())
  none = dict.fromkeys((tiers.FAST, tiers.SLOW), 0)
  for key in set(predicted) | set(sent):  # (a few bytes of scalars over `pipeline` the estimate leaves out)
    for tier in (tiers.FAST, tiers.SLOW):
      assert predicted.get(key, none)[tier] == pytest.approx(sent.get(key, none)[tier], rel=0.02, abs=1024), key


def test_two_processes_standing_for_slices_cross_between_them_only_over_data(tmp_path):
  port = free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
  processes = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "two_slices.py"), f"localhost:{port}", str(i)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
  outputs = [p.communicate(timeout=200) for p in processes]
  for process, (_, err) in zip(processes, outputs):
    assert process.returncode == 0, err[-3000:]
  result = json.loads(outputs[0][0].strip().splitlines()[-1])
  # The slow-tier groups read off mesh coordinates are the processes the devices belong to.
  assert result["processes"] == result["slow_tier_groups"]
  assert np.array(result["processes"]).reshape(4, 2).tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
  spans = {(kind, axes): groups for kind, axes, groups in result["collectives"]}
  assert spans[("all-reduce", "tensor")] == 1 and spans[("all-reduce", "data")] == 2
  assert all(groups == 1 for (_, axes), groups in spans.items() if "data" not in axes)
  assert result["by_tier"]["all-reduce over tensor"]["slow"] == 0
  data = result["by_tier"]["all-reduce over data"]
  assert data["slow"] == pytest.approx((data["fast"] + data["slow"]) / 3, rel=1e-3)  # (2-1)/(4-1)
