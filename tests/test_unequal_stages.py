"""Unequal pipeline stages (first and last chunks shorter, parallel/stages.py) compute what one device computes,
under every schedule, with ZeRO-3 and with experts, and gather each stage by the all-to-alls they promise."""

import types

import jax
import numpy as np
import pytest

from helpers import (STEPS, assert_params_close, assert_tree_close, loss_and_gradients, objective_and_gradients,
                     run_layout, setup)
from measure import analysis
from measure.sizes import Pipeline
from model.transformer import STACKED
from parallel import stages
from parallel.mesh import PIPELINE

DEEP = {"model.num_layers": 8, "pipeline.microbatches": 4}
SHORT_ENDS = {"pipeline.first_stage_layers": 1, "pipeline.last_stage_layers": 1}  # 1, 3, 3, 1 over four chunks
LAYOUTS = {
    "gpipe, pipeline=4 x data=2: 1 3 3 1": {"mesh.pipeline": 4, "mesh.data": 2, **SHORT_ENDS},
    "1f1b, pipeline=2 x data=4: 3 5": {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "1f1b",
                                       "pipeline.first_stage_layers": 3, "pipeline.last_stage_layers": 5},
    "interleaved, pipeline=2 x V=2 x tensor=2 x data=2: 1 3 3 1": {
        "mesh.pipeline": 2, "mesh.tensor": 2, "mesh.data": 2, "pipeline.schedule": "interleaved",
        "pipeline.virtual_stages": 2, **SHORT_ENDS},
    # The empty slots' lax.cond around a layer whose attention exchanges heads over `sequence`.
    "gpipe, pipeline=2 x sequence=2 x data=2, Ulysses: 3 5": {
        "mesh.pipeline": 2, "mesh.sequence": 2, "mesh.data": 2, "attention.context": "ulysses",
        "pipeline.first_stage_layers": 3, "pipeline.last_stage_layers": 5},
}


@pytest.fixture(scope="module")
def reference():
  return run_layout({**DEEP, "mesh.data": 1}, jax.devices()[:1])


def test_the_chunks_hold_the_layers_in_order_with_empty_slots_last():
  eight = types.SimpleNamespace(num_units=8, layers_per_unit=1)
  units = stages.stage_units(eight, Pipeline("interleaved", 4, 2, first_stage_layers=1, last_stage_layers=1), 2)
  assert units == (1, 3, 3, 1)
  # Two devices, two chunks each: device 0 runs chunks 0 and 2, device 1 chunks 1 and 3.
  assert stages.slot_units(units, 2).tolist() == [[[0, 0, 0], [4, 5, 6]], [[1, 2, 3], [7, 0, 0]]]
  assert stages.live_slots(units, 2).tolist() == [[[True, False, False], [True, True, True]],
                                                   [[True, True, True], [True, False, False]]]
  # Llama 3 405B's recipe: 126 layers over 16 stages, the first and last one layer short.
  llama_405b = types.SimpleNamespace(num_units=126, layers_per_unit=1)
  assert stages.stage_units(llama_405b, Pipeline("1f1b", 16, 1, first_stage_layers=7, last_stage_layers=7),
                            16) == (7, *[8] * 14, 7)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unequal_stages_match_one_device(layout, reference):
  loss, grads = loss_and_gradients({**DEEP, **LAYOUTS[layout]}, jax.devices())
  np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
  assert_tree_close(grads, reference[1], "gradient")


def test_unequal_stages_under_zero3_train_as_one_device(reference):
  # The stack lies split over pipeline x data by `embed`, pipeline-major; its gradients leave the stages
  # reduce-scattered over data in that order, and the optimizer updates each device's share.
  loss, grads, params = run_layout({**DEEP, "mesh.pipeline": 2, "mesh.data": 4, "sharding.zero": 3,
                                    "pipeline.first_stage_layers": 3, "pipeline.last_stage_layers": 5},
                                   jax.devices())
  np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
  assert_tree_close(grads, reference[1], "gradient")
  assert_params_close(params, reference[2], f"parameter after {STEPS} steps")


def test_each_stage_is_gathered_by_one_all_to_all_per_weight_split_by_embed():
  _, layout, state, batch = setup({**DEEP, "mesh.pipeline": 4, "mesh.data": 2, **SHORT_ENDS}, jax.devices())
  stored = jax.tree.leaves(jax.tree.map(lambda w: w.sharding.spec, state["params"][STACKED]),
                           is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert all(spec[0] is None for spec in stored)  # no layer axis over `pipeline`: 8 layers do not split 1, 3, 3, 1
  split = sum(PIPELINE in spec for spec in stored)
  assert split >= 8  # every weight with an `embed` axis
  found = analysis.collectives(objective_and_gradients(layout).lower(state["params"], batch).compile(), layout.mesh)
  # One all-to-all per split weight gathers the stages and its transpose returns their gradients; the
  # head's rows take the other two (as under equal stages).
  assert analysis.count_by(found, kind="all-to-all", axes=PIPELINE) == 2 * split + 2, analysis.summary_table(found)


LLAMA_MOE = {"model.family": "llama", "model.kv_heads": 2, "model.num_layers": 4, "model.embed_dim": 32,
             "model.mlp_dim": 64, "model.max_len": 16, "moe.experts": 4, "moe.capacity_factor": 1.0,
             "pipeline.microbatches": 2}


def test_moe_figures_are_means_over_the_layers_whatever_the_chunks_hold():
  # A chunk's router figures are its slots' mean, an empty slot's zero: the step's must still be the stack's
  # mean over its 4 layers, as grad_accum=2 on one device gives.
  config, layout, state, batch = setup({**LLAMA_MOE, "mesh.data": 1, "grad_accum": 2}, jax.devices()[:1])
  (ref_loss, ref_stats), ref_grads = jax.device_get(
      objective_and_gradients(layout, config.grad_accum)(state["params"], batch))
  _, layout, state, batch = setup({**LLAMA_MOE, "mesh.pipeline": 2, "mesh.data": 4,
                                   "pipeline.first_stage_layers": 1, "pipeline.last_stage_layers": 3},
                                  jax.devices())
  (loss, stats), grads = jax.device_get(objective_and_gradients(layout)(state["params"], batch))
  assert ref_stats["moe_dropped"] > 0.05  # drops happen, so agreeing on them is tested
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for key, value in ref_stats.items():
    np.testing.assert_allclose(stats[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
  assert_tree_close(grads, ref_grads, "gradient")


def test_muon_deals_the_stack_as_its_moments_lie():
  # Muon's round robin gathers each hidden matrix's momentum from the moments' layout, which unequal stages
  # split over pipeline x data by `embed` (ZeRO-1): the parameters after the steps are one device's.
  muon = {"model.num_layers": 3, "pipeline.microbatches": 2, "optimizer.name": "muon"}
  reference = run_layout({**muon, "mesh.data": 1}, jax.devices()[:1])
  _, _, params = run_layout({**muon, "mesh.pipeline": 2, "mesh.data": 4, "sharding.zero": 1,
                             "pipeline.first_stage_layers": 1, "pipeline.last_stage_layers": 2}, jax.devices())
  assert_params_close(params, reference[2], f"parameter after {STEPS} steps")
