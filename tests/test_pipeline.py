"""Pipeline schedules compute the unpipelined numbers (dense and MoE, float32 to float16), run the tables they
print, and 1F1B saves memory."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (BF16_LOSS_RTOL, FP16_GRADIENT_TOLERANCES, FP16_LOSS_RTOL, ROOT, STEPS,
                     assert_half_gradients_close, assert_params_close, assert_tree_close, loss_and_gradients,
                     objective_and_gradients, run_layout, setup, tiny_config)
from measure import analysis, pipeline_bubble
from parallel import schedules
from parallel.mesh import EXPERT
from training.state import plan
from training.step import compile_train_step

DEEP = {"model.num_layers": 8, "pipeline.microbatches": 4}  # 8 layers split over P x V = 2 x 4 or 4 x 2
LAYOUTS = {
    "pipeline=2": {"mesh.pipeline": 2, "mesh.data": 4},
    "pipeline=4": {"mesh.pipeline": 4, "mesh.data": 2},
    "pipeline=2 x tensor=2 x data=2": {"mesh.pipeline": 2, "mesh.tensor": 2, "mesh.data": 2},
}
# Every schedule on the pure pipelines; the 3-D layout once here (interleaved, the most involved) and under
# 1F1B in test_3d_parallel_1f1b_step_matches_unpipelined.
CASES = [(layout, schedule) for layout in LAYOUTS for schedule in schedules.SCHEDULES
         if LAYOUTS[layout].get("mesh.tensor", 1) == 1 or schedule == "interleaved"]


@pytest.fixture(scope="module")
def reference():
  return run_layout({**DEEP, "mesh.data": 1}, jax.devices()[:1])


def overrides(layout, schedule):
  virtual = 4 if LAYOUTS[layout]["mesh.pipeline"] == 2 else 2
  return {**DEEP, **LAYOUTS[layout], "pipeline.schedule": schedule, "pipeline.virtual_stages": virtual}


@pytest.mark.parametrize("layout, schedule", CASES, ids=[f"{l} {s}" for l, s in CASES])
def test_schedule_matches_unpipelined(layout, schedule, reference):
  loss, grads = loss_and_gradients(overrides(layout, schedule), jax.devices())
  np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
  assert_tree_close(grads, reference[1], "gradient")


def test_3d_parallel_1f1b_step_matches_unpipelined(reference):
  _, _, params = run_layout(overrides("pipeline=2 x tensor=2 x data=2", "1f1b"), jax.devices())
  assert_params_close(params, reference[2], f"parameter after {STEPS} steps")


# Pipelining combined with other features, each against the same model on one device. Two layers (one per
# stage) and two micro-batches keep the compiles short.
SHALLOW = {"model.num_layers": 2, "pipeline.microbatches": 2}


@pytest.fixture(scope="module")
def shallow_reference():
  return run_layout({**SHALLOW, "mesh.data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("sharding", [{"mesh.data": 2, "mesh.tensor": 2, "sharding.zero": 3},
                                      {"mesh.data": 4, "sharding.fsdp_group": 2, "sharding.zero": 3},
                                      {"mesh.data": 4, "sharding.zero": 1}],
                         ids=["fsdp x tensor", "hybrid fsdp", "zero-1"])
def test_pipeline_with_zero_and_grad_accumulation_matches_single_device(sharding, shallow_reference):
  # ZeRO-3 shards the stage weights and their moments over data (or over hybrid sharding's groups on
  # `expert`), ZeRO-1 the moments alone; either way the gradients leave the stages reduce-scattered. Each
  # of 2 accumulated micro-batches runs the whole schedule; the parameters after STEPS steps see both.
  combined = {**SHALLOW, **sharding, "mesh.pipeline": 2, "grad_accum": 2}
  loss, grads, params = run_layout(combined, jax.devices())
  ref_loss, ref_grads, ref_params = shallow_reference
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")
  assert_params_close(params, ref_params, f"parameter after {STEPS} steps")


LLAMA_BF16 = {**SHALLOW, "model.family": "llama", "model.kv_heads": 2, "precision.compute": "bfloat16"}


@pytest.fixture(scope="module")
def llama_bf16_reference():
  return loss_and_gradients({**LLAMA_BF16, "mesh.data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_llama_in_bf16_matches_single_device_bf16(schedule, llama_bf16_reference):
  pipelined = {**LLAMA_BF16, "mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": schedule}
  loss, grads = loss_and_gradients(pipelined, jax.devices())
  np.testing.assert_allclose(loss, llama_bf16_reference[0], rtol=BF16_LOSS_RTOL)
  assert_half_gradients_close(grads, llama_bf16_reference[1], "bfloat16 gradient")


# Pipeline x sequence: a context strategy attends inside the stages, in the map the schedule already runs
# manual over `sequence`. Four layers (2 x 2 chunks under interleaved), two micro-batches, pipeline=2 x
# sequence=2 x data=2. Every strategy and every schedule at least once, the ring (whose hops every device
# must run together, so its idle slots compute and discard) under both the circular schedules' code and
# 1F1B's, 1F1B's with packed documents, which travel with their tokens into the micro-batches and round the
# ring.
STAGED_SEQUENCE = {"model.num_layers": 4, "pipeline.microbatches": 2, "pipeline.virtual_stages": 2,
                   "mesh.pipeline": 2, "mesh.sequence": 2, "mesh.data": 2}
SEQUENCE_CASES = [("gpipe", "ring", False), ("1f1b", "allgather", False),
                  ("1f1b", "ring", True), ("interleaved", "ulysses", True)]


@pytest.fixture(scope="module")
def four_layer_references():
  one_device = {"model.num_layers": 4, "mesh.data": 1}
  return {packed: loss_and_gradients({**one_device, "model.document_end": 10 if packed else -1}, jax.devices()[:1])
          for packed in (False, True)}


@pytest.mark.parametrize("schedule, context, packed", SEQUENCE_CASES,
                         ids=[f"{s} {c}" + (" packed" if p else "") for s, c, p in SEQUENCE_CASES])
def test_a_sharded_sequence_inside_the_stages_matches_one_device(schedule, context, packed, four_layer_references):
  loss, grads = loss_and_gradients({**STAGED_SEQUENCE, "pipeline.schedule": schedule, "attention.context": context,
                                    "model.document_end": 10 if packed else -1}, jax.devices())
  ref_loss, ref_grads = four_layer_references[packed]
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")


def test_all_five_axes_at_once_match_one_device():
  # tests/five_axes.py in a process of its own with 32 simulated devices: a MoE Llama on data=2 x tensor=2 x
  # pipeline=2 x sequence=2 x expert=2 (1f1b, ring attention), against one device with grad_accum=2.
  result = subprocess.run([sys.executable, str(ROOT / "tests" / "five_axes.py")], capture_output=True, text=True,
                          cwd=ROOT / "tests", env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  found = json.loads(result.stdout.splitlines()[-1])
  assert found["dropped"] > 0.05  # a fifth of the choices dropped: the layouts agree on which
  assert found["loss"] < 1e-5 and found["gradients"] < 1e-5, found
  assert max(found["stats"].values()) < 1e-5, found["stats"]
  collectives = found["collectives"]
  for expected in ("all-reduce over tensor", "collective-permute over pipeline", "collective-permute over sequence",
                   "all-to-all over expert"):
    assert expected in collectives, collectives
  assert any(c.startswith("all-reduce over data") for c in collectives), collectives
  # The estimator's bytes for each kind and axes it predicts, and in all, within the 10% every layout keeps.
  assert all(0.9 <= ratio <= 1.1 for ratio in found["compiled_over_estimate"].values()), found["compiled_over_estimate"]
  assert 0.9 <= found["total_compiled_over_estimate"] <= 1.1, found["total_compiled_over_estimate"]


# A mixture of experts pipelines as grad_accum accumulates: each of the M micro-batches is routed, balanced and
# dropped on its own, so the reference is one device with grad_accum=M. Capacity 1.0 drops a fifth of the
# choices, so the layouts must agree on drops too; four layers split into P x V = 2 x 2 chunks.
LLAMA_MOE = {"model.family": "llama", "model.kv_heads": 2, "model.num_layers": 4, "model.embed_dim": 32,
             "model.mlp_dim": 64, "model.max_len": 16, "moe.experts": 4, "moe.capacity_factor": 1.0,
             "pipeline.microbatches": 2, "pipeline.virtual_stages": 2}


@pytest.fixture(scope="module")
def moe_reference():
  config, layout, state, batch = setup({**LLAMA_MOE, "mesh.data": 1, "grad_accum": 2}, jax.devices()[:1])
  return jax.device_get(objective_and_gradients(layout, config.grad_accum)(state["params"], batch))


def assert_matches_moe_reference(result, reference):
  (loss, stats), grads = result
  (ref_loss, ref_stats), ref_grads = reference
  assert ref_stats["moe_dropped"] > 0.05  # drops happen, so agreeing on them is tested
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert stats.keys() == ref_stats.keys()
  for key, value in ref_stats.items():  # cross-entropy, balancing and z-losses, their weighted sum, drops, loads
    np.testing.assert_allclose(stats[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
  assert_tree_close(grads, ref_grads, "gradient")


@pytest.mark.parametrize("schedule", schedules.SCHEDULES)
def test_moe_schedule_matches_one_device_accumulating_the_micro_batches(schedule, moe_reference):
  _, layout, state, batch = setup({**LLAMA_MOE, "mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": schedule},
                                  jax.devices())
  assert_matches_moe_reference(jax.device_get(objective_and_gradients(layout)(state["params"], batch)),
                               moe_reference)


def test_moe_1f1b_with_expert_parallelism_exchanges_tokens_inside_the_stages(moe_reference):
  _, layout, state, batch = setup({**LLAMA_MOE, "mesh.pipeline": 2, "mesh.expert": 2, "mesh.data": 2,
                                   "pipeline.schedule": "1f1b"}, jax.devices())
  step = objective_and_gradients(layout).lower(state["params"], batch).compile()
  assert_matches_moe_reference(jax.device_get(step(state["params"], batch)), moe_reference)
  found = analysis.collectives(step, layout.mesh)
  # A MoE layer (the body of the stage's layer loop) dispatches and combines by all-to-all over `expert` in the
  # forward slot, and its gradients go back the same two routes in the backward slot: 4, all inside the loops.
  assert analysis.count_by(found, kind="all-to-all", axes=EXPERT, in_loop=True) == 4, analysis.summary_table(found)
  assert analysis.count_by(found, kind="all-to-all", axes=EXPERT) == 4, analysis.summary_table(found)


GPT2_MOE_FP16 = {**SHALLOW, "moe.experts": 4, "moe.capacity_factor": 1.0, "precision.compute": "float16"}


def test_1f1b_in_float16_scales_the_loss_as_one_device_does_and_overflows_as_it_does():
  # 1F1B's hand-written backward must carry the loss scale from the head and from each stage's auxiliary loss
  # to every gradient: a part left unscaled would be 2^15 times too small.
  scale, overflowing = jnp.float32(2.0**15), jnp.float32(2.0**40)  # precision.loss_scale's start; far past float16
  config, layout, state, batch = setup({**GPT2_MOE_FP16, "mesh.data": 1, "grad_accum": 2}, jax.devices()[:1])
  (ref_loss, ref_stats), ref_grads = jax.device_get(
      objective_and_gradients(layout, config.grad_accum)(state["params"], batch, scale))
  _, layout, state, batch = setup({**GPT2_MOE_FP16, "mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "1f1b"},
                                  jax.devices())
  step = objective_and_gradients(layout)
  (loss, stats), grads = jax.device_get(step(state["params"], batch, scale))
  np.testing.assert_allclose(loss, ref_loss, rtol=FP16_LOSS_RTOL)
  for key, value in ref_stats.items():  # means over the tokens, as the loss is
    np.testing.assert_allclose(stats[key], value, rtol=FP16_LOSS_RTOL, err_msg=key)
  assert_half_gradients_close(grads, ref_grads, "float16 gradient", FP16_GRADIENT_TOLERANCES)
  # 2^40 x the loss overflows float16 in the backward pass while the loss stays finite: what the train step
  # takes for the scaler's overflow, dropping the update and halving the scale (tests/test_precision.py).
  (loss, _), grads = jax.device_get(step(state["params"], batch, overflowing))
  assert np.isfinite(loss) and not all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def temp_bytes(schedule):
  config = tiny_config(**{"mesh.pipeline": 2, "mesh.data": 4, "model.num_layers": 4, "batch_size": 32,
                          "pipeline.microbatches": 8, "pipeline.schedule": schedule})
  return analysis.memory_summary(compile_train_step(plan(config), config))["temp_bytes"]


def test_1f1b_needs_less_temporary_memory_than_gpipe():
  # M = 8 >= 2P = 4: GPipe keeps every micro-batch's activations for the backward pass, 1F1B at most 2P - 1 inputs.
  assert temp_bytes("1f1b") < temp_bytes("gpipe")


def test_bubble_formulas_divide_by_the_total_and_by_the_ideal_time():
  # P=4, M=32: 3 idle ticks of 35 (bubble/total), 3 idle ticks per 32 busy ones (bubble/ideal, Megatron-LM's).
  assert schedules.bubble_over_total(stages=4, micro=32) == pytest.approx(3 / 35)  # 0.0857
  assert schedules.bubble_over_ideal(stages=4, micro=32) == pytest.approx(3 / 32)  # 0.09375
  # V=2 chunks: as if there were 2M micro-batches.
  assert schedules.bubble_over_total(stages=4, micro=8, virtual=2) == pytest.approx(3 / 19)
  assert schedules.bubble_over_ideal(stages=4, micro=8, virtual=2) == pytest.approx(3 / 16)


@pytest.mark.parametrize("stages, micro, virtual", [(2, 4, 1), (4, 4, 1), (4, 8, 1), (4, 8, 2), (2, 6, 3)])
def test_circular_schedule_idles_bubble_over_total(stages, micro, virtual):
  schedule = "interleaved" if virtual > 1 else "gpipe"
  rows = schedules.timeline(schedule, stages=stages, micro=micro, virtual=virtual)
  # Each device runs every micro-batch through each of its V chunks exactly once.
  for row in rows:
    busy = [c for c in row if c != "."]
    assert len(busy) == len(set(busy)) == micro * virtual
  np.testing.assert_allclose(schedules.idle_fraction(schedule, stages=stages, micro=micro, virtual=virtual),
                             schedules.bubble_over_total(stages=stages, micro=micro, virtual=virtual))


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 8), (4, 16)])
def test_1f1b_has_gpipes_bubble(stages, micro):
  np.testing.assert_allclose(schedules.idle_fraction("1f1b", stages=stages, micro=micro),
                             schedules.bubble_over_total(stages=stages, micro=micro))


def test_bubble_tool_prints_the_docs_table():
  with open(ROOT / "docs" / "parallelism.md") as f:
    page = f.read()
  assert pipeline_bubble.bubble_table(4, [4, 8, 16, 32, 64], 2) in page  # docs/parallelism.md quotes it verbatim


def test_1f1b_timeline_is_the_textbook_table():
  rows = schedules.timeline("1f1b", stages=2, micro=4)
  assert rows == [["F0", "F1", "F2/B0", "F3/B1", "B2", "B3"],
                  [".", "F0/B0", "F1/B1", "F2/B2", "F3/B3", "."]]
