"""Optimizer rules, weight-decay masks and the warmup-cosine schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
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


def test_decay_skips_embeddings_and_vectors_unless_asked():
  config = tiny_config()
  params = plan(config, jax.devices()[:1]).abstract_state["params"]
  mask = decay_mask(params, config)
  assert mask["blocks"]["mlp"]["up_kernel"] and mask["blocks"]["attn"]["qkv_kernel"]
  assert not mask["blocks"]["mlp"]["up_bias"] and not mask["blocks"]["ln_attn"]["scale"]
  assert not mask["embed"]["tokens"] and not mask["ln_final"]["scale"]
  config.optimizer.decay_embeddings, config.optimizer.decay_1d = True, True
  assert all(jax.tree.leaves(decay_mask(params, config)))


def update(name, grad, weight, **overrides):
  config = tiny_config(**{"optimizer.name": name, "optimizer.lr": 0.1, "optimizer.weight_decay": 0.5,
                          "optimizer.clip_norm": 0.0, "optimizer.decay_1d": True,
                          "schedule.warmup_steps": 0, "schedule.decay": "constant", **overrides})
  params = {"w": jnp.array([weight])}
  tx = make_optimizer(config, params)
  updates, _ = tx.update({"w": jnp.array([grad])}, tx.init(params), params)
  return float(updates["w"][0])


def test_adamw_decouples_decay_from_the_adaptive_step():
  # Adam's first step is lr * sign(g); AdamW adds lr * wd * w outside it, Adam+L2 folds wd*w into g.
  np.testing.assert_allclose(update("adam", 2.0, 4.0), -0.1, rtol=1e-5)
  np.testing.assert_allclose(update("adamw", 2.0, 4.0), -0.1 - 0.1 * 0.5 * 4.0, rtol=1e-5)
  np.testing.assert_allclose(update("adam_l2", 2.0, 4.0), -0.1, rtol=1e-5)  # sign unchanged
  np.testing.assert_allclose(update("adam_l2", 1.0, -4.0), 0.1, rtol=1e-5)  # g + wd*w = -1 flips it


def test_sgd_and_momentum():
  np.testing.assert_allclose(update("sgd", 2.0, 4.0), -0.2, rtol=1e-6)
  np.testing.assert_allclose(update("momentum", 2.0, 4.0), -0.2, rtol=1e-6)


def test_clipping_bounds_the_global_norm():
  assert update("sgd", 30.0, 0.0, **{"optimizer.clip_norm": 1.0}) == pytest.approx(-0.1)


def test_unknown_optimizer_is_refused():
  with pytest.raises(ValueError, match="optimizer.name='lion' is unknown"):
    update("lion", 1.0, 1.0)
