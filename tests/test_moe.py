"""Mixture of experts: routing, capacity and losses; expert parallelism equals one device; the HLO's all-to-alls."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (BF16_GRADIENT_TOLERANCES, BF16_LOSS_RTOL, assert_half_gradients_close, assert_tree_close, compiled_forward, loss_and_gradients,
                     objective_and_gradients, read_metrics, setup, tiny_config)
from model.config import ModelConfig
import moe_reference
from measure import analysis, moe_memory
from model.moe import AUX_LOSS, MoE, _top_k, capacity, route
from parallel.mesh import DATA, EXPERT
from run.loop import train
from training.state import active_param_count, param_count, plan
from training.step import compile_train_step

# Capacity 1.0 on the tiny model drops about a fifth of the choices, so the layouts must agree on drops too.
GPT2_MOE = {"moe.experts": 8, "moe.top_k": 2, "moe.capacity_factor": 1.0}
LLAMA_MOE = {**GPT2_MOE, "model.family": "llama", "model.kv_heads": 2, "model.num_layers": 4, "moe.every": 2}


def moe_config(num_experts=4, top_k=2, capacity_factor=1.0, dropless=False):
  return ModelConfig(family="gpt2", num_layers=2, num_heads=2, embed_dim=8, mlp_dim=16, max_len=8,
                     vocab_size=16, num_experts=num_experts, moe_top_k=top_k,
                     moe_capacity_factor=capacity_factor, moe_dropless=dropless)


def test_top_k_by_argmax_matches_lax_top_k():
  probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (4, 16, 8)), axis=-1)
  for k in (1, 2, 3):
    np.testing.assert_array_equal(_top_k(probs, k), jax.lax.top_k(probs, k)[1])


def test_capacity_keeps_the_earliest_first_choices():
  cfg = moe_config(num_experts=4, top_k=1, capacity_factor=1.0)
  slots = capacity(cfg, group_size=8)  # 1.0 x 8 tokens x k=1 / 4 experts
  assert slots == 2
  logits = jnp.zeros((1, 8, 4)).at[..., 0].set(5.0)  # every token wants expert 0
  routing, stats = route(logits, jnp.arange(8), cfg)
  np.testing.assert_array_equal(routing.slot_BTK[0, :, 0], np.arange(8))  # ranked by position
  kept_tokens = np.nonzero(np.asarray(routing.slot_BTK[0, :, 0] < slots))[0]
  np.testing.assert_array_equal(kept_tokens, [0, 1])
  assert float(stats["moe_dropped"]) == pytest.approx(6 / 8)
  np.testing.assert_allclose(stats["expert_load"], [1.0, 0.0, 0.0, 0.0])
  # With k = 1 the combine weight is the router probability of the chosen expert.
  np.testing.assert_allclose(routing.weights_BTK[0, 0, 0], jax.nn.softmax(logits[0, 0])[0], rtol=1e-6)


def test_first_choices_outrank_second_choices():
  cfg = moe_config(num_experts=4, top_k=2, capacity_factor=0.5)  # 0.5 x 4 x 2 / 4 = 1 slot
  # Token 0 picks expert 1 second; token 1 picks it first: token 1 gets the slot.
  logits = jnp.array([[[3.0, 2.0, 0.0, 0.0], [0.0, 3.0, 2.0, 0.0], [0.0, 0.0, 3.0, 2.0], [2.0, 0.0, 0.0, 3.0]]])
  routing, _ = route(logits, jnp.arange(4), cfg)
  np.testing.assert_array_equal(routing.experts_BTK[0], [[0, 1], [1, 2], [2, 3], [3, 0]])
  np.testing.assert_array_equal(routing.slot_BTK[0], [[0, 1], [0, 1], [0, 1], [0, 1]])


def test_routing_follows_positions_not_array_order():
  cfg = moe_config(num_experts=4, top_k=2, capacity_factor=1.0)
  logits = jax.random.normal(jax.random.key(1), (2, 8, 4))
  order = jnp.array([0, 7, 1, 6, 2, 5, 3, 4])  # a zig-zag order, as ring attention lays tokens out
  in_order, _ = route(logits, jnp.arange(8), cfg)
  reordered, _ = route(logits[:, order], order, cfg)
  for a, b in zip(in_order[:3], reordered[:3]):  # experts, weights and slots
    np.testing.assert_array_equal(a[:, order], b)


def test_dropless_drops_nothing():
  cfg = moe_config(num_experts=4, top_k=2, dropless=True)
  logits = jnp.zeros((2, 8, 4)).at[..., 0].set(5.0)
  routing, stats = route(logits, jnp.arange(8), cfg)
  assert float(stats["moe_dropped"]) == 0.0
  np.testing.assert_array_equal(routing.counts_BE, [[8, 8, 0, 0]] * 2)  # both choices of every token placed
  np.testing.assert_array_equal(routing.slot_BTK[0, :, 1], np.arange(8))  # every second choice of expert 1


def layer_loss_and_grads(call, layer, x_BTD, positions_T):
  """A position-weighted sum of the layer's output plus its auxiliary loss; its gradients and statistics."""
  def loss(layer, x_BTD):
    y_BTD, stats = call(layer, x_BTD, positions_T)
    return (y_BTD * jnp.arange(1, y_BTD.shape[-1] + 1)).sum() + stats[AUX_LOSS], (y_BTD, stats)

  (_, (y_BTD, stats)), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x_BTD)
  return y_BTD, stats, grads


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dropless", [False, True])
def test_sorted_dispatch_equals_the_one_hot_reference(family, top_k, dropless):
  cfg = dataclasses.replace(moe_config(top_k=top_k, dropless=dropless), family=family)
  with nnx.use_eager_sharding(False):
    layer = MoE(cfg, nnx.Rngs(params=0))
  layer.router[...] = jax.random.normal(jax.random.key(2), layer.router[...].shape)  # spread, uneven loads
  x = jax.random.normal(jax.random.key(3), (2, 8, cfg.embed_dim))
  zig_zag = jnp.array([0, 7, 1, 6, 2, 5, 3, 4])
  y, stats, grads = layer_loss_and_grads(MoE.__call__, layer, x, zig_zag)
  ref_y, ref_stats, ref_grads = layer_loss_and_grads(moe_reference.call, layer, x, zig_zag)
  assert dropless or ref_stats["moe_dropped"] > 0.1  # drops happen, so agreeing on them is tested
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5 * np.abs(ref_y).max())
  for key, value in ref_stats.items():
    np.testing.assert_allclose(stats[key], value, rtol=1e-6, err_msg=key)
  assert_tree_close(grads, ref_grads, "gradient")


def test_balancing_loss_is_one_when_balanced_and_grows_with_skew():
  cfg = moe_config(num_experts=4, top_k=1)
  uniform = route(jnp.zeros((1, 8, 4)), jnp.arange(8), cfg)[1]
  assert float(uniform["moe_balance_loss"]) == pytest.approx(1.0)
  skewed = route(jnp.zeros((1, 8, 4)).at[..., 0].set(5.0), jnp.arange(8), cfg)[1]
  assert float(skewed["moe_balance_loss"]) > 3.5  # E * f_0 * P_0 = 4 * 1 * 0.98
  assert float(skewed["moe_z_loss"]) == pytest.approx(float(jax.nn.logsumexp(jnp.array([5.0, 0, 0, 0]))) ** 2)


def router_figures_by_hand(x_BTD, router_DE, k):
  """Expert loads, balancing loss and z-loss from the router logits and a count of their top k."""
  logits = np.einsum("btd,de->bte", x_BTD.astype(np.float64), router_DE.astype(np.float64))
  experts = logits.shape[-1]
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  chosen = np.argsort(-logits, axis=-1)[..., :k]  # each token's k highest logits
  load = np.bincount(chosen.ravel(), minlength=experts) / chosen.size  # share of the k B T choices
  log_sum_exp = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
  return {"expert_load": load, "moe_balance_loss": experts * np.sum(load * probs.mean((0, 1))),
          "moe_z_loss": np.mean(log_sum_exp**2)}


def test_router_figures_match_a_hand_count_of_the_top_k_choices():
  cfg = moe_config(num_experts=4, top_k=2)
  with nnx.use_eager_sharding(False):  # a bare layer, on no mesh
    layer = MoE(cfg, nnx.Rngs(params=0))
  # A router of unit scale (not the init's 0.02) spreads the logits, so no two experts nearly tie
  # and float32 ranks the choices as float64 does.
  layer.router[...] = jax.random.normal(jax.random.key(2), layer.router[...].shape)
  x = jax.random.normal(jax.random.key(3), (2, 8, cfg.embed_dim))
  _, stats = layer(x, jnp.arange(8))
  expected = router_figures_by_hand(np.asarray(x), np.asarray(layer.router[...]), k=2)
  assert len(set(expected["expert_load"])) > 1  # unequal loads: a swapped or averaged count shows
  # Loads are counts over 32 choices, exact in float32; the losses are float32 sums of a few terms.
  np.testing.assert_allclose(stats["expert_load"], expected["expert_load"], rtol=1e-6)
  np.testing.assert_allclose(stats["moe_balance_loss"], expected["moe_balance_loss"], rtol=1e-5)
  np.testing.assert_allclose(stats["moe_z_loss"], expected["moe_z_loss"], rtol=1e-5)


def router_run(overrides, devices):
  """Objective, router statistics and gradients, traced as the train step traces them."""
  _, layout, state, batch = setup(overrides, devices)
  return jax.device_get(objective_and_gradients(layout)(state["params"], batch))


@pytest.fixture(scope="module")
def references():
  return {"gpt2": router_run({**GPT2_MOE, "mesh.data": 1}, jax.devices()[:1]),
          "llama": router_run({**LLAMA_MOE, "mesh.data": 1}, jax.devices()[:1])}


EXPERT_LAYOUTS = {
    "expert=2 x data=4": ("gpt2", {"mesh.expert": 2, "mesh.data": 4}),
    "expert=8": ("gpt2", {"mesh.expert": 8, "mesh.data": 1}),
    "expert=2 x tensor=2 x fsdp data=2": ("gpt2", {"mesh.expert": 2, "mesh.tensor": 2, "mesh.data": 2,
                                                   "sharding.zero": 3}),
    "llama every=2, expert=4 x tensor=2": ("llama", {"mesh.expert": 4, "mesh.tensor": 2, "mesh.data": 1}),
    # Hybrid sharding: the groups on `expert` shard the experts as expert parallelism does, ZeRO-3 the rest.
    "hsdp data=8 in groups of 4": ("gpt2", {"mesh.data": 8, "sharding.zero": 3, "sharding.fsdp_group": 4}),
    "llama expert=2 x sequence=2 ring x data=2": ("llama", {"mesh.expert": 2, "mesh.sequence": 2, "mesh.data": 2,
                                                            "attention.context": "ring"}),
}


@pytest.mark.parametrize("name", EXPERT_LAYOUTS)
def test_expert_parallel_matches_single_device(name, references):
  family, layout_overrides = EXPERT_LAYOUTS[name]
  model_overrides = GPT2_MOE if family == "gpt2" else LLAMA_MOE
  (loss, stats), grads = router_run({**model_overrides, **layout_overrides}, jax.devices())
  (ref_loss, ref_stats), ref_grads = references[family]
  assert ref_stats["moe_dropped"] > 0.05  # drops happen, so agreeing on them is tested
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_array_equal(stats["moe_dropped"], ref_stats["moe_dropped"])  # the same tokens dropped
  np.testing.assert_allclose(stats["expert_load"], ref_stats["expert_load"], rtol=1e-6)
  assert_tree_close(grads, ref_grads, "gradient")


# Sharded runs of the sorted dispatch against the one-hot reference on one device, for the settings
# the expert-parallel layouts above leave out: top-1, dropless (ragged_dot on one expert shard, the
# C = T slot layout across shards) and capacity, both families.
REFERENCE_LAYOUTS = {
    "gpt2 top-1 dropless, expert=2 x tensor=2 x data=2": (
        {"moe.experts": 8, "moe.top_k": 1, "moe.dropless": True},
        {"mesh.expert": 2, "mesh.tensor": 2, "mesh.data": 2}),
    "gpt2 top-2 dropless, data=4 x tensor=2": (
        {"moe.experts": 8, "moe.top_k": 2, "moe.dropless": True}, {"mesh.tensor": 2, "mesh.data": 4}),
    "llama top-2 dropless, expert=4 x data=2": (
        {**LLAMA_MOE, "moe.dropless": True}, {"mesh.expert": 4, "mesh.data": 2}),
    "llama top-1 capacity, expert=2 x tensor=2 x data=2": (
        {**LLAMA_MOE, "moe.top_k": 1}, {"mesh.expert": 2, "mesh.tensor": 2, "mesh.data": 2}),
}


@pytest.mark.parametrize("name", REFERENCE_LAYOUTS)
def test_sharded_sorted_dispatch_equals_the_one_hot_reference(name, monkeypatch):
  model_overrides, layout_overrides = REFERENCE_LAYOUTS[name]
  (loss, stats), grads = router_run({**model_overrides, **layout_overrides}, jax.devices())
  with monkeypatch.context() as patch:
    patch.setattr(MoE, "__call__", moe_reference.call)
    (ref_loss, ref_stats), ref_grads = router_run({**model_overrides, "mesh.data": 1}, jax.devices()[:1])
  assert model_overrides.get("moe.dropless") or ref_stats["moe_dropped"] > 0.05
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for key, value in ref_stats.items():
    np.testing.assert_allclose(stats[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
  assert_tree_close(grads, ref_grads, "gradient")


def test_dropless_grouped_matmul_keeps_the_batch_sharded():
  config = tiny_config(**{"moe.experts": 8, "moe.dropless": True, "mesh.tensor": 2, "mesh.data": 4})
  layout = plan(config)
  found = analysis.collectives(compile_train_step(layout, config), layout.mesh)
  assert analysis.count_by(found, kind="all-gather", axes=DATA) == 0, analysis.summary_table(found)


def test_expert_parallel_step_dispatches_with_all_to_all():
  config = tiny_config(**{**GPT2_MOE, "mesh.expert": 4, "mesh.data": 2})
  layout = plan(config)
  forward = analysis.collectives(compiled_forward(layout, config), layout.mesh)
  # Dispatch and combine: two all-to-alls over `expert` per layer, and nothing gathered.
  assert analysis.count_by(forward, kind="all-to-all", axes=EXPERT, in_loop=True) == 2, (
      analysis.summary_table(forward))
  assert analysis.count_by(forward, kind="all-gather") == 0, analysis.summary_table(forward)
  step = analysis.collectives(compile_train_step(layout, config), layout.mesh)
  # The backward pass sends the gradients back along the same two routes.
  assert analysis.count_by(step, kind="all-to-all", axes=EXPERT, in_loop=True) == 4, analysis.summary_table(step)


@pytest.mark.parametrize("family, dropless", [("gpt2", False), ("llama", True)])
def test_layer_temporaries_grow_linearly_in_the_sequence(family, dropless):
  cfg = moe_memory.layer_config(family, embed=64, mlp=256, experts=8, top_k=2, capacity_factor=1.0,
                                dropless=dropless)
  (temp, flops), (temp_2t, flops_2t) = moe_memory.measure(cfg, 512), moe_memory.measure(cfg, 1024)
  # One-hot dispatch held (B, T, E, C) tensors with C ~ T: 3.8x (capacity) and 2.8x (dropless) here.
  assert temp_2t <= 2.2 * temp, (temp, temp_2t)
  assert flops_2t == pytest.approx(flops, rel=1e-3)  # no term of the work grows faster than T
  if not dropless:
    # Capacity factor 1.0: k T slots, so the experts do the active work; one-hot dispatch did 2.4x at T=512.
    assert 1.0 <= flops <= 1.2, flops


def test_flops_count_active_parameters_only():
  layout = plan(tiny_config(**GPT2_MOE), jax.devices()[:1])
  d, f = layout.model.embed_dim, layout.model.mlp_dim
  dense_layout = plan(tiny_config(), jax.devices()[:1])
  # Top-2 of 8 experts: each token uses two expert MLPs and the router where the dense model has one MLP.
  extra = layout.model.num_layers * (2 * d * f + f + d + d * 8)
  assert active_param_count(layout) == param_count(dense_layout) + extra
  assert param_count(layout) == param_count(dense_layout) + layout.model.num_layers * (7 * (2 * d * f + f + d) + d * 8)


def test_training_logs_router_figures_and_matches_expert_one(tmp_path):
  common = {**GPT2_MOE, "steps": 4, "log_every": 2, "eval_every": 0, "sample_tokens": 0}
  runs = {}
  for name, mesh in {"expert=4": {"mesh.expert": 4, "mesh.data": 2}, "expert=1": {"mesh.data": 8}}.items():
    train(tiny_config(**common, **mesh, workdir=str(tmp_path / name)))
    runs[name] = read_metrics(tmp_path / name)
  assert len(runs["expert=4"]) == len(runs["expert=1"]) == 2
  for sharded, single in zip(runs["expert=4"], runs["expert=1"]):
    assert sharded["loss"] == pytest.approx(single["loss"], rel=1e-5)
    # Each expert's logged share, the balancing loss and the drops are those of the unsharded run: the
    # same tokens went to the same experts (the shares themselves are checked by hand above).
    for key in [f"expert_load/{i}" for i in range(8)] + ["moe_balance_loss", "moe_dropped"]:
      assert sharded[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("overrides, message", [
    ({"moe.experts": 6, "mesh.expert": 4, "mesh.data": 2}, "moe.experts=6 is not divisible by mesh.expert=4"),
    ({"moe.experts": 4, "moe.top_k": 5}, "moe.top_k=5 must be between 1 and moe.experts=4"),
    ({"moe.experts": 4, "moe.capacity_factor": 0.0}, "moe.capacity_factor=0.0 must be positive"),
    ({"moe.experts": 4, "moe.every": 3}, "moe.every=3 does not divide model.num_layers=2"),
    ({"moe.experts": 4, "moe.every": 2, "mesh.pipeline": 2, "mesh.data": 4},
     r"model.num_layers=2 in groups of 2 \(moe.every\) does not split into mesh.pipeline=2"),
    ({"moe.experts": 4, "moe.dropless": True, "precision.compute": "float8"},
     "moe.dropless=True with precision.compute=float8"),
])
def test_bad_moe_settings_are_refused_in_one_line(overrides, message):
  with pytest.raises(ValueError, match=message.replace(".", r"\.")):
    plan(tiny_config(**overrides))


def test_bf16_experts_under_expert_parallelism_match_one_device_bf16():
  """bfloat16 experts round their matmuls in bfloat16 (model/layers.py _rounded_einsum); under expert
  parallelism their weights' gradients are summed over `data` inside the all-to-all's shard_map, which the
  rule must do itself (before, the step did not compile). One device runs the dropless experts as grouped
  matmuls (ragged_dot), expert parallelism as slots, each rounding the weights' gradients its own way: they
  are held to twice the dense layouts' bound (1.6e-2 measured on a gate kernel, against 2^-6)."""
  overrides = {**LLAMA_MOE, "moe.dropless": True, "precision.compute": "bfloat16"}
  loss, grads = loss_and_gradients({**overrides, "mesh.data": 1}, jax.devices()[:1])
  mesh_loss, mesh_grads = loss_and_gradients({**overrides, "mesh.expert": 2, "mesh.data": 4}, jax.devices())
  np.testing.assert_allclose(mesh_loss, loss, rtol=BF16_LOSS_RTOL)
  assert_half_gradients_close(mesh_grads, grads, "bfloat16 expert gradient",
                              (2 * BF16_GRADIENT_TOLERANCES[0], BF16_GRADIENT_TOLERANCES[1]))
