"""The step-time model's arithmetic against cases worked by hand, and its calibration per device kind."""

import pytest

from configs.gpt2 import get_config
from configs.load import set_fields
from measure import calibration, estimate, hardware, step_time, tiers
from measure.dry_run import model_weights

H100 = hardware.KINDS["h100"]
MESH = {"data": 1, "pipeline": 1, "expert": 1, "sequence": 1, "tensor": 1}


def gpt2(**overrides):
  c = get_config("124m")
  c.precision.compute, c.batch_size = "bfloat16", 8
  return set_fields(c, overrides)


def test_hops_by_hand():
  # An all-reduce over 16 devices, 8 inside each of 2 hosts: 2 x 7 steps on NVLink, 2 x 1 across.
  assert step_time.hops("all-reduce", inside=8, groups=2) == {tiers.FAST: 14, tiers.SLOW: 2}
  assert step_time.hops("all-gather", inside=8, groups=2) == {tiers.FAST: 7, tiers.SLOW: 1}
  assert step_time.hops("all-to-all", inside=4, groups=2) == {tiers.FAST: 3, tiers.SLOW: 4}
  assert step_time.hops("collective-permute", inside=4, groups=2) == {tiers.FAST: 0, tiers.SLOW: 1}


def test_an_all_reduce_across_the_slow_tier_by_hand():
  cluster = hardware.cluster("h100", 16)
  mesh = {**MESH, "data": 16}
  # 15 GB of ring bytes over data=16 in 2 hosts: 1/15 of them cross, (2-1)/(16-1).
  (by_tier,) = tiers.split({("all-reduce", "data"): 15 * 10**9}, mesh, {"data": 2}).values()
  assert by_tier == {tiers.FAST: 14 * 10**9, tiers.SLOW: 10**9}
  seconds = step_time.collective_seconds("all-reduce", "data", by_tier, 3, mesh, {"data": 2}, cluster)
  latency = 3 * (14 * 5e-6 + 2 * 10e-6)  # 3 calls, 14 NVLink and 2 InfiniBand ring steps each
  assert seconds == pytest.approx(14e9 / 450e9 + 1e9 / 50e9 + latency, rel=1e-12)


def test_a_data_parallel_step_is_its_matmuls_and_the_last_layers_reduction():
  config, cluster = gpt2(**{"mesh.data": 8, "batch_size": 64}), hardware.cluster("h100", 8)
  mesh, weights = {**MESH, "data": 8}, model_weights(config)
  t = step_time.predict(config, mesh, {}, cluster, weights, achievable=0.5)
  flops = estimate.flops(config, mesh, weights)
  rate = H100.bf16_flops * 0.5
  # Each part at the larger of its FLOPs' and its bytes' time: the GEMMs are the FLOPs' (compute-bound at
  # 8 x 1,024 tokens a device), the pointwise work between them the bytes'.
  moved = step_time.bytes_moved(config, mesh, weights)
  assert t.compute == pytest.approx(sum(t.parts.values()), rel=1e-12)
  assert t.parts["pointwise"] == pytest.approx(moved["pointwise"] / H100.hbm_bandwidth, rel=1e-12)
  assert t.parts["gemms"] + t.parts["attention"] == pytest.approx(flops["layers"] / rate, rel=1e-12)
  assert t.compute > flops["total"] / rate
  assert t.bubble == 0
  # The gradients' all-reduce (hidden under the backward pass, 2/3 of the layers' matmuls) shows only
  # its last layer's bucket: 1/12 of it for GPT-2 124M's 12 layers.
  reduction = t.communication["gradients"]
  assert reduction < flops["layers"] * 2 / 3 / rate
  assert t.exposed["gradients"] == pytest.approx(reduction / 12, rel=1e-12)
  assert t.step == pytest.approx(t.compute + reduction / 12, rel=1e-12)
  assert t.tokens_per_second == pytest.approx(64 * 1024 / t.step, rel=1e-12)


def test_a_pipelines_bubble_is_p_minus_1_over_m_of_its_busy_time():
  mesh = {**MESH, "pipeline": 4}
  config = gpt2(**{"mesh.pipeline": 4, "mesh.data": 1, "pipeline.microbatches": 4, "pipeline.schedule": "gpipe"})
  weights = model_weights(config)
  t = step_time.predict(config, mesh, {}, hardware.cluster("h100", 4), weights, achievable=0.5)
  busy = sum(t.parts[part] for part in ("gemms", "attention", "pointwise", "saved"))  # the layers' parts
  assert t.bubble == pytest.approx(busy * 3 / 4, rel=1e-12)  # (P - 1) / M of the busy ticks, P = M = 4


def test_recomputation_lengthens_the_step_by_its_flops():
  weights = model_weights(gpt2())
  plain = step_time.predict(gpt2(), MESH, {}, hardware.cluster("h100", 1), weights, 0.5)
  full = step_time.predict(gpt2(**{"model.remat": "full"}), MESH, {}, hardware.cluster("h100", 1), weights, 0.5)
  extra = estimate.flops(gpt2(**{"model.remat": "full"}), MESH, weights)["recompute"]
  matmuls = lambda t: t.parts["gemms"] + t.parts["attention"]
  assert matmuls(full) - matmuls(plain) == pytest.approx(extra / (H100.bf16_flops * 0.5), rel=1e-9)
  # The pointwise work runs again with the forward: three passes over its values where there were two
  # (each written and read per forward run, its gradient once in the backward).
  assert full.parts["pointwise"] == pytest.approx(plain.parts["pointwise"] * 3 / 2, rel=1e-9)
  assert full.step > plain.step
  assert full.mfu < plain.mfu


def test_the_bytes_each_part_moves_by_hand():
  config, weights = gpt2(), model_weights(gpt2())
  moved = step_time.bytes_moved(config, MESH, weights)
  state = estimate.memory(config, MESH, weights)
  saved = estimate.saved_per_layer(config, MESH)["device"] * 12
  # Nothing recomputed: the values between the GEMMs written and read forward, their gradients backward;
  # the same values read back once more as what the layer saved.
  assert moved["pointwise"] == 4 * saved
  assert moved["saved"] == saved
  # Adam in float32: parameters (4 bytes an element) and m and v (8) read and written, gradients (4) read.
  assert state["opt_state"] == 2 * state["params"]
  assert moved["optimizer"] == 7 * state["params"]
  # 8 x 1,024 tokens' logits over GPT-2's padded vocabulary in bfloat16, five times; the tied table thrice.
  vocab = estimate.dims(config, MESH).vocab
  assert moved["loss"] == (5 * 8 * 1024 * vocab + 3 * vocab * 768) * 2


def test_a_layout_whose_activations_cannot_be_sized_is_still_timed():
  """The planner times a layout's best case before it sizes its memory: the optimizer's traffic reads the
  train state alone, not the activation estimate, which has no micro-batch to size here (2 sequences
  over 2 replicas and 2 micro-batches; the Llama 3 70B search on v5p met one)."""
  config = gpt2(**{"batch_size": 2, "mesh.data": 2, "mesh.pipeline": 2, "pipeline.schedule": "1f1b",
                   "pipeline.microbatches": 2})
  mesh = {**MESH, "data": 2, "pipeline": 2}
  t = step_time.predict(config, mesh, {}, hardware.cluster("h100", 4), model_weights(config), 0.5)
  assert t.step > 0


def test_a_small_models_step_is_longer_for_its_memory_bound_parts():
  """GPT-2 124M on one H200 (benchmarks/h200): the pointwise work, the saved values and the optimizer's
  update are HBM-bound, and add to the GEMMs' time (the loss's head matmul stays compute-bound)."""
  config, weights = gpt2(**{"batch_size": 32}), model_weights(gpt2())
  t = step_time.predict(config, MESH, {}, hardware.cluster("h200", 1), weights, 0.5)
  moved = step_time.bytes_moved(config, MESH, weights)
  bandwidth = hardware.KINDS["h200"].hbm_bandwidth
  for part in ("pointwise", "saved", "optimizer"):
    assert t.parts[part] == pytest.approx(moved[part] / bandwidth, rel=1e-12), part


def test_float32_has_no_peak_to_price_it_at():
  with pytest.raises(ValueError, match=r"^precision.compute=float32 has no step-time model"):
    step_time.predict(gpt2(**{"precision.compute": "float32"}), MESH, {}, hardware.cluster("h100", 1),
                      model_weights(gpt2()), 0.5)


@pytest.mark.parametrize("kind", ["a100", "h100", "tpu_v4"])
def test_each_kind_is_calibrated_to_its_reference_runs_step(kind):
  fraction = calibration.achievable_fraction(kind)
  reference = calibration.REFERENCES[kind]
  assert 0.1 < fraction < 1
  assert calibration.predicted_step(reference, fraction) == pytest.approx(reference.step_seconds, rel=1e-3)


def test_attention_slower_than_the_matmuls_lengthens_the_step_by_its_extra_time():
  config, weights = gpt2(**{"model.max_len": 1024}), model_weights(gpt2())
  cluster = hardware.cluster("h100", 1)
  fused = step_time.predict(config, MESH, {}, cluster, weights, 0.5)
  unfused = step_time.predict(config, MESH, {}, cluster, weights, 0.5, attention_slowdown=4)
  d = estimate.dims(config, MESH)
  parts = estimate.stage_forward(config, d, MESH, weights)
  attention = (parts["scores"] + parts["values"]) * 3 / (H100.bf16_flops * 0.5)  # forward once, backward twice
  assert unfused.step - fused.step == pytest.approx(3 * attention, rel=1e-9)
