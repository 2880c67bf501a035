"""Muon (training/muon.py): the iteration, which parameters it trains, its update's scale, and every layout
equal to one device.

Tolerance: float32 throughout. The layouts differ in the order of reductions only, and the iteration on a
gathered matrix runs the same matmuls as on one device, so parameters after STEPS steps agree to 1e-5 of
each one's largest entry, as AdamW's do (tests/test_equivalence.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import STEPS, assert_params_close, params_after_steps, tiny_config
from measure import analysis, estimate
from measure.dry_run import compile_partitioned_train_step, model_weights
from training import muon
from training.state import build_model, model_config, plan

MUON = {"optimizer.name": "muon"}
EXPERTS = {"model.family": "llama", "moe.experts": 4}


def test_newton_schulz_brings_every_singular_value_near_one():
  # Five quintic steps from x / ||x||_F: the singular values of a random 64 x 256 matrix, spread over a
  # factor of 3 (0.5 to 1.5 x 16), land in [0.68, 1.13] (Jordan's coefficients aim at about [0.7, 1.2]);
  # a tall matrix is iterated transposed and comes back tall.
  x = jax.random.normal(jax.random.key(0), (2, 64, 256))
  for matrix in (x, jnp.swapaxes(x, 1, 2)):
    singular = np.linalg.svd(np.asarray(muon.newton_schulz(matrix, 5)), compute_uv=False)
    assert singular.min() > 0.6 and singular.max() < 1.2, (singular.min(), singular.max())
  raw = np.linalg.svd(np.asarray(x), compute_uv=False)
  assert raw.max() / raw.min() > 2.5  # the iteration did the flattening, not the input


def muon_parameters(overrides):
  """Parameter name -> its Matrix, or None where AdamW trains it."""
  config = tiny_config(**MUON, **overrides)
  with nnx.use_eager_sharding(False):
    params = nnx.state(nnx.eval_shape(lambda: build_model(model_config(config), 0)), nnx.Param)
  logical = nnx.to_pure_dict(nnx.get_partition_spec(params))
  described = jax.tree.leaves_with_path(muon.matrices(nnx.to_pure_dict(params), logical),
                                     is_leaf=lambda m: m is None or isinstance(m, muon.Matrix))
  return {jax.tree_util.keystr(path, simple=True, separator="/"): m for path, m in described}


@pytest.mark.parametrize("overrides, matrices, some_adamw", [
    ({}, {"blocks/attn/qkv_kernel": ((1,), (3, 4)), "blocks/attn/out_kernel": ((1, 2), (3,)),
          "blocks/mlp/up_kernel": ((1,), (2,)), "blocks/mlp/down_kernel": ((1,), (2,))},
     {"embed/tokens", "embed/positions", "blocks/attn/qkv_bias", "blocks/ln_attn/scale", "ln_final/bias"}),
    ({"model.family": "qwen2", "moe.experts": 4, "moe.shared_width": 32, "moe.every": 1}, {
        **{f"blocks/layers/{i}/attn/{p}_kernel": ((1,), (2, 3)) for i in (0,) for p in "qkv"},
        **{f"blocks/layers/{i}/attn/out_kernel": ((1, 2), (3,)) for i in (0,)},
        **{f"blocks/layers/{i}/mlp/{p}_kernel": ((2,), (3,)) for i in (0,) for p in ("up", "gate", "down")},
        **{f"blocks/layers/{i}/mlp/shared/{p}_kernel": ((1,), (2,)) for i in (0,) for p in ("up", "gate", "down")}},
     {"embed", "head", "blocks/layers/0/mlp/router", "blocks/layers/0/mlp/shared_gate_kernel",
      "blocks/layers/0/attn/q_bias", "norm_final/scale"}),
])
def test_muon_trains_the_layers_matrices_and_adamw_the_rest(overrides, matrices, some_adamw):
  """Which parameters each optimizer trains, and each matrix's input and output axes (the others are batch
  axes: layers, experts, GPT-2's q/k/v). Embeddings, the head, norms, biases, the router and the shared
  expert's gate (embed -> 1) stay with AdamW."""
  found = muon_parameters(overrides)
  assert {name: (m.inputs, m.outputs) for name, m in found.items() if m} == matrices
  assert {name for name, m in found.items() if m is None} >= some_adamw


def test_refuses_a_kernel_it_cannot_orient():
  params = {"blocks": {"mix_kernel": jnp.zeros((2, 4, 4))}}
  logical = {"blocks": {"mix_kernel": jax.sharding.PartitionSpec("layers", "heads", "mlp")}}
  with pytest.raises(ValueError, match=r"^Kernel \['blocks'\]\['mix_kernel'\] \(logical axes \('layers', 'heads', "
                                       r"'mlp'\)\) has no input and output side that Muon and muP can tell") as e:
    muon.matrices(params, logical)
  assert "\n" not in str(e.value)


def test_the_update_has_adamw_s_rms():
  # Liu et al.'s scale: rms x sqrt(max(fan_in, fan_out)) on a semi-orthogonal matrix, whose RMS is
  # 1 / sqrt(max(fan_in, fan_out)), gives an RMS of rms = 0.2 whatever the shape (x the singular values'
  # spread around 1).
  for shape in ((64, 256), (256, 64), (96, 96)):
    transform = muon.scale_by_muon([muon.Matrix((0,), (1,))], beta=0.95, steps=5, rms=0.2)
    grads = jax.random.normal(jax.random.key(1), shape)
    update, _ = transform.update(grads, transform.init(grads))
    rms = float(jnp.sqrt(jnp.mean(update ** 2)))
    assert 0.17 < rms < 0.21, (shape, rms)


LAYOUTS = {
    "data=8": {"mesh.data": 8},
    "zero1 data=8": {"mesh.data": 8, "sharding.zero": 1},
    "fsdp data=8": {"mesh.data": 8, "sharding.zero": 3},
    "fsdp data=8, gathered": {"mesh.data": 8, "sharding.zero": 3, "optimizer.muon_iteration": "gathered"},
    "fsdp data=4 x tensor=2, dealt over both": {"mesh.data": 4, "mesh.tensor": 2, "sharding.zero": 3},
    "hsdp data=8 in groups of 4": {"mesh.data": 8, "sharding.zero": 3, "sharding.fsdp_group": 4},
    "data=2 x tensor=4": {"mesh.data": 2, "mesh.tensor": 4},
    "fsdp data=4 x pipeline=2": {"mesh.data": 4, "mesh.pipeline": 2, "sharding.zero": 3},
    "fsdp data=4 x tensor=2, the partitioner splitting the iteration": {
        "mesh.data": 4, "mesh.tensor": 2, "sharding.zero": 3, "optimizer.muon_iteration": "partitioned"},
    "experts: data=2 x expert=2 x tensor=2, fsdp": {**EXPERTS, "mesh.data": 2, "mesh.expert": 2, "mesh.tensor": 2,
                                                    "sharding.zero": 3},
}


@pytest.fixture(scope="module")
def one_device():
  """Muon's parameters on one device, dense and with experts."""
  single = jax.devices()[:1]
  return {"dense": params_after_steps(MUON, single), "experts": params_after_steps({**MUON, **EXPERTS}, single),
}


def test_muon_moves_the_matrices_unlike_adamw():
  """Two steps (warmup's lr is 0 at the first): both runs see the same two gradients, so AdamW's parameters
  move alike under both and Muon's matrices do not."""
  single = jax.devices()[:1]
  initial, runs = params_after_steps(MUON, single, 0), {name: params_after_steps({"optimizer.name": name}, single, 2)
                                                       for name in ("muon", "adamw")}
  moved = lambda run: run["blocks"]["mlp"]["up_kernel"] - initial["blocks"]["mlp"]["up_kernel"]
  assert np.abs(moved(runs["muon"]) - moved(runs["adamw"])).max() > 0.5 * np.abs(moved(runs["adamw"])).max()
  assert_params_close(runs["muon"]["embed"], runs["adamw"]["embed"], "the embedding, AdamW's under both")


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_device(name, one_device):
  overrides = LAYOUTS[name]
  reference = one_device["experts" if overrides.get("moe.experts") else "dense"]
  assert_params_close(params_after_steps({**MUON, **overrides}, jax.devices()), reference,
                      f"{name}: parameter after {STEPS} steps")


def test_round_robin_sends_and_computes_least():
  """The three iterations compiled on fsdp data=8, beside AdamW's step. Round robin deals the eight 64 x 64
  matrices (q, k, v and output of two layers) one a device and the four 64 x 256 (MLP up, down transposed)
  one a device of the first four, and sends 143360 bytes more (all-to-all there and back); gathering sends
  344064 (every matrix's momentum, 4 x 98304 x 7/8) and iterates on every matrix on every device, 5 x round
  robin's FLOPs; left to the partitioner, the iteration's matmuls gather each iterate again: 4157520 bytes,
  for the fewest FLOPs. The estimate counts round robin's and the gather's bytes and FLOPs exactly."""
  sent, flops = {}, {}
  for iteration in ("adamw", *muon.ITERATIONS):
    config = tiny_config(**{"mesh.data": 8, "sharding.zero": 3}, **({} if iteration == "adamw" else {
        **MUON, "optimizer.muon_iteration": iteration}))
    layout = plan(config)
    program, partitioned = compile_partitioned_train_step(layout, config)
    sent[iteration] = analysis.traffic_per_step(analysis.collectives(program, layout.mesh, partitioned))
    flops[iteration] = analysis.matmul_flops(program, partitioned)
    if iteration in ("round_robin", "gathered"):
      mesh, weights = dict(layout.mesh.shape), model_weights(config)
      estimated = estimate.collectives_by_source(config, mesh, weights)["optimizer"]
      assert {key: sent[iteration][key] - sent["adamw"].get(key, 0) for key in estimated} == estimated, iteration
      assert flops[iteration] - flops["adamw"] == estimate.optimizer_flops(config, mesh, weights), iteration
  extra = {name: sum(sent[name].values()) - sum(sent["adamw"].values()) for name in muon.ITERATIONS}
  assert extra["round_robin"] < extra["gathered"] < extra["partitioned"] / 10, extra
  iterated = {name: flops[name] - flops["adamw"] for name in muon.ITERATIONS}
  assert iterated["partitioned"] < iterated["round_robin"] < iterated["gathered"] / 2, iterated


def test_refuses_an_unknown_iteration():
  with pytest.raises(ValueError, match=r"^optimizer.muon_iteration='split' is unknown; use one of round_robin, "
                                       r"gathered, partitioned\.$"):
    muon.matrices({}, {}, iteration="split")
