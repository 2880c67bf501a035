"""The planner's memory knobs against the limits beside the device's own memory, and the calibration that
prices them: offloading is planned only where the host's memory per device holds what it parks, and the
v5p fraction is fitted to the recompute its run did, not to full recomputation."""

import dataclasses

from configs.gpt2 import get_config
from measure import calibration, estimate, hardware, planner
from measure.dry_run import model_weights

CLUSTER = hardware.cluster("h100", 8, fast_group=4)


def test_the_v5p_fraction_is_fitted_to_the_recompute_its_run_did(monkeypatch):
  # MaxText's run kept attention's output (offloaded) and recomputed the rest; pricing it as full
  # recomputation charged FLOPs it never ran, and so fitted a higher fraction of peak.
  reference = calibration.REFERENCES["tpu_v5p"]
  assert reference.flags["model.remat"] == "save_attention"
  as_run = calibration.achievable_fraction.__wrapped__("tpu_v5p")
  as_full = dataclasses.replace(reference, flags={**reference.flags, "model.remat": "full"})
  monkeypatch.setitem(calibration.REFERENCES, "tpu_v5p", as_full)
  assert as_run < calibration.achievable_fraction.__wrapped__("tpu_v5p") - 0.01


def test_offloading_is_planned_only_where_the_host_holds_what_it_parks():
  config = get_config("tiny")
  config.precision.compute, config.batch_size, config.model.num_layers = "bfloat16", 16, 4
  weights = model_weights(config)
  achievable = calibration.achievable_fraction("h100")
  offloading = {"model.remat": "offload"}
  roomy = planner.search(config, CLUSTER, weights, achievable, top=3, fixed=offloading).ranked
  assert roomy
  parked = [estimate.host_memory(planner.configured(config, c.flags), c.mesh) for c in roomy]
  assert all(0 < p <= CLUSTER.kind.host_bytes * 0.9 for p in parked)
  # A host with room for less than the most an offloading layout parks: those that park more give way,
  # and with room for none, no offloading layout is ranked and nothing is refused.
  for host_bytes, ranked in [(max(parked), True), (1024, False)]:
    cramped = dataclasses.replace(CLUSTER, kind=dataclasses.replace(CLUSTER.kind, host_bytes=host_bytes))
    kept = planner.search(config, cramped, weights, achievable, top=3, fixed=offloading).ranked
    assert bool(kept) == ranked
    assert all(estimate.host_memory(planner.configured(config, c.flags), c.mesh) <= host_bytes * 0.9 for c in kept)
  assert planner.search(config, cramped, weights, achievable, top=3).ranked


def test_the_loss_in_smaller_chunks_is_planned_where_its_logits_do_not_fit_whole():
  # One sequence of 4,096 tokens on one device: the head's logits in one chunk of 4,096 (the config's) or
  # four of 1,024, with a budget between the two at the leanest of every other knob.
  config = get_config("tiny")
  config.precision.compute, config.batch_size, config.model.num_layers = "bfloat16", 1, 2
  config.model.vocab_size, config.model.max_len = 32768, 4096
  one = hardware.cluster("h100", 1)
  weights = model_weights(config)
  mesh = planner.hybrid_shape({"data": 1, "pipeline": 1, "expert": 1, "sequence": 1, "tensor": 1}, 0)
  lean = {"model.remat": "full", "model.mlp_chunk": planner.MLP_CHUNKS[-1]}
  whole, chunked = (sum(estimate.memory(planner.configured(config, {**lean, "model.loss_chunk": c}), mesh,
                                        weights).values()) for c in planner.LOSS_CHUNKS)
  assert chunked < whole
  headroom = 1 - (whole + chunked) / 2 / one.kind.hbm_bytes
  ranked = planner.search(config, one, weights, calibration.achievable_fraction("h100"), headroom=headroom,
                          top=3).ranked
  assert ranked and all(c.flags["model.loss_chunk"] == planner.LOSS_CHUNKS[-1] for c in ranked)
  assert "loss_chunk=1024" in ranked[0].settings
