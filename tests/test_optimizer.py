"""Optimizer rules, weight-decay masks and the warmup-cosine schedule."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tiny_config
from training.optimizer import decay_mask, learning_rate, make_optimizer
from training.state import plan


def test_schedule_warms_up_then_decays_to_the_floor():
  config = tiny_config(**{"steps": 110, "schedule.warmup_steps": 10, "optimizer.lr": 1.0,
                          "schedule.final_lr_ratio": 0.1})
  lr = learning_rate(config)
  assert float(lr(0)) == 0.0
  np.testing.assert_allclose(float(lr(5)), 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(lr(10)), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(lr(60)), 0.55, rtol=1e-5)  # halfway down the cosine
  np.testing.assert_allclose(float(lr(110)), 0.1, rtol=1e-5)


# Every parameter that weight decay touches by default, per family and variant, written out by
# hand: kernels, MoE routers and Llama's untied head. Biases of any rank (GPT-2's QKV bias is
# (3, heads, head_dim), an expert's bias (experts, mlp)), norm gains and embeddings are not.
GPT2_BLOCK_DECAYED = ["attn']['out_kernel", "attn']['qkv_kernel", "mlp']['down_kernel", "mlp']['up_kernel"]
LLAMA_BLOCK_DECAYED = ["attn']['k_kernel", "attn']['out_kernel", "attn']['q_kernel", "attn']['v_kernel",
                       "mlp']['down_kernel", "mlp']['gate_kernel", "mlp']['up_kernel"]
DECAYED = {
    ("gpt2", "tiny"): {f"['blocks']['{name}']" for name in GPT2_BLOCK_DECAYED},
    ("gpt2", "moe_tiny"): {f"['blocks']['layers'][0]['{name}']" for name in GPT2_BLOCK_DECAYED + ["mlp']['router"]},
    ("llama", "tiny"): {f"['blocks']['{name}']" for name in LLAMA_BLOCK_DECAYED} | {"['head']"},
    ("llama", "moe_tiny"): ({f"['blocks']['layers'][{i}]['{name}']" for i in (0, 1) for name in LLAMA_BLOCK_DECAYED}
                            | {"['blocks']['layers'][1]['mlp']['router']", "['head']"}),
}


def variant_params(family, variant):
  config = importlib.import_module(f"configs.{family}").get_config(variant)
  return config, plan(config, jax.devices()[:1]).abstract_state["params"]


@pytest.mark.parametrize("family,variant", list(DECAYED))
def test_decay_mask_names_every_decayed_parameter(family, variant):
  config, params = variant_params(family, variant)
  mask = decay_mask(params, config)
  decayed = {jax.tree_util.keystr(path) for path, decays in jax.tree_util.tree_leaves_with_path(mask) if decays}
  assert decayed == DECAYED[family, variant]
  config.optimizer.decay_embeddings, config.optimizer.decay_1d = True, True
  assert all(jax.tree.leaves(decay_mask(params, config)))


def test_decay_mask_refuses_a_parameter_of_unknown_kind():
  with pytest.raises(ValueError, match=r"\['blocks'\]\['gain'\] has no weight-decay kind"):
    decay_mask({"blocks": {"gain": jnp.ones(3)}}, tiny_config())


def test_adamw_shrinks_only_the_decayed_parameters_over_several_steps():
  # With zero gradients Adam's step is zero, so after n steps AdamW leaves w * (1 - lr * wd)^n
  # where decay applies and w exactly elsewhere: a QKV bias or expert bias that moved would show.
  config, abstract = variant_params("gpt2", "moe_tiny")
  config.optimizer.lr, config.optimizer.weight_decay = 0.1, 0.5
  config.schedule.warmup_steps, config.schedule.decay = 0, "constant"
  params = jax.tree.map(lambda leaf: jnp.ones(leaf.shape, leaf.dtype), abstract)
  tx = make_optimizer(config, params)
  opt_state, zeros = tx.init(params), jax.tree.map(jnp.zeros_like, params)
  for _ in range(3):
    updates, opt_state = tx.update(zeros, opt_state, params)
    params = optax.apply_updates(params, updates)

  def check(path, leaf, decays):
    np.testing.assert_allclose(leaf, (1 - 0.1 * 0.5) ** 3 if decays else 1.0, rtol=1e-6,
                               err_msg=jax.tree_util.keystr(path))

  jax.tree_util.tree_map_with_path(check, params, decay_mask(params, config))


def updates(name, grads, weight, **overrides) -> list[float]:
  """The updates of successive steps that see `grads`, the weight held at `weight`."""
  config = tiny_config(**{"optimizer.name": name, "optimizer.lr": 0.1, "optimizer.weight_decay": 0.5,
                          "optimizer.clip_norm": 0.0,
                          "schedule.warmup_steps": 0, "schedule.decay": "constant", **overrides})
  params = {"kernel": jnp.array([weight])}
  tx = make_optimizer(config, params)
  opt_state, seen = tx.init(params), []
  for grad in grads:
    step, opt_state = tx.update({"kernel": jnp.array([grad])}, opt_state, params)
    seen.append(float(step["kernel"][0]))
  return seen


def update(name, grad, weight, **overrides) -> float:
  return updates(name, [grad], weight, **overrides)[0]


def test_adamw_decouples_decay_from_the_adaptive_step():
  # Adam's first step is lr * sign(g); AdamW adds lr * wd * w outside it, Adam+L2 folds wd*w into g.
  np.testing.assert_allclose(update("adam", 2.0, 4.0), -0.1, rtol=1e-5)
  np.testing.assert_allclose(update("adamw", 2.0, 4.0), -0.1 - 0.1 * 0.5 * 4.0, rtol=1e-5)
  np.testing.assert_allclose(update("adam_l2", 2.0, 4.0), -0.1, rtol=1e-5)  # sign unchanged
  np.testing.assert_allclose(update("adam_l2", 1.0, -4.0), 0.1, rtol=1e-5)  # g + wd*w = -1 flips it


def test_sgd_and_momentum():
  # From zero velocity momentum's first step is SGD's; the second carries 0.9 of the first along.
  np.testing.assert_allclose(updates("sgd", [2.0, 2.0], 4.0), [-0.2, -0.2], rtol=1e-6)
  np.testing.assert_allclose(updates("momentum", [2.0, 2.0], 4.0), [-0.2, -0.2 * 1.9], rtol=1e-6)
  np.testing.assert_allclose(updates("momentum", [2.0, 0.0], 4.0, **{"optimizer.momentum": 0.5}), [-0.2, -0.1],
                             rtol=1e-6)


def test_clipping_bounds_the_global_norm():
  assert update("sgd", 30.0, 0.0, **{"optimizer.clip_norm": 1.0}) == pytest.approx(-0.1)


def test_unknown_optimizer_is_refused():
  with pytest.raises(ValueError, match="optimizer.name='lion' is unknown"):
    update("lion", 1.0, 1.0)


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["adamw", "adam", "adam_l2", "sgd", "momentum"])
def test_gradients_of_finite_norm_at_a_finite_rate_keep_the_state_finite(name, moments):
  # What nonfinite_check=scalars rests on (training/step.py), at float32's edge: a gradient of 1.8e19, whose
  # square (3.2e38) only just sums finitely, seen 200 times so that v climbs to it, clipped or not.
  grads = {"kernel": jnp.array([1.8e19, -1e-30])}
  assert np.isfinite(float(optax.tree.norm(grads)))
  for clip in (0.0, 1.0):
    config = tiny_config(**{"optimizer.name": name, "optimizer.lr": 0.1, "optimizer.weight_decay": 0.5,
                            "optimizer.clip_norm": clip, "precision.moments": moments,
                            "schedule.warmup_steps": 0, "schedule.decay": "constant"})
    params = {"kernel": jnp.array([0.5, -0.5])}
    tx = make_optimizer(config, params)

    def step(carry, _):
      updates, opt_state = tx.update(grads, carry[1], carry[0])
      return (optax.apply_updates(carry[0], updates), opt_state), None

    state = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), length=200)[0])(params, tx.init(params))
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in floats), (clip, state)
