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
  assert t.compute == pytest.approx(flops["total"] / rate, rel=1e-12)
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
  flops = estimate.flops(config, mesh, weights)
  busy = (flops["layers"] + flops["recompute"]) / (H100.bf16_flops * 0.5)
  assert t.bubble == pytest.approx(busy * 3 / 4, rel=1e-12)  # (P - 1) / M of the busy ticks, P = M = 4


def test_recomputation_lengthens_the_step_by_its_flops():
  weights = model_weights(gpt2())
  plain = step_time.predict(gpt2(), MESH, {}, hardware.cluster("h100", 1), weights, 0.5)
  full = step_time.predict(gpt2(**{"model.remat": "full"}), MESH, {}, hardware.cluster("h100", 1), weights, 0.5)
  extra = estimate.flops(gpt2(**{"model.remat": "full"}), MESH, weights)["recompute"]
  assert full.step - plain.step == pytest.approx(extra / (H100.bf16_flops * 0.5), rel=1e-9)
  assert full.mfu < plain.mfu


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
