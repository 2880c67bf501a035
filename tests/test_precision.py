"""Precision policies (fp32, bf16, fp16 with loss scaling, fp8; bf16 moments) and remat policies."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from model import fp8
from parallel import analysis
from parallel.checks import check_backend
from test_equivalence import assert_tree_close, gradients
from training import data, loss_scale
from training.dry_run import abstract_inputs, compile_train_step
from training.state import init_state, model_config, plan
from training.step import make_train_step


def first_step(compute):
  config = tiny_config(**{"precision.compute": compute, "mesh.data": 4, "mesh.tensor": 2})
  layout = plan(config)
  state = init_state(layout, config.seed)
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=0, step=0, batch_size=config.batch_size,
                            seq_len=config.model.max_len, sharding=layout.batch_sharding)
  step = make_train_step(layout, config)
  hlo = step.lower(*abstract_inputs(layout, config)).as_text()
  state, metrics = step(state, batch)
  return float(metrics["loss"]), state, hlo


def test_bf16_compute_keeps_fp32_masters_and_follows_fp32():
  loss32, _, hlo32 = first_step("float32")
  loss16, state16, hlo16 = first_step("bfloat16")
  assert {x.dtype for x in jax.tree.leaves(state16["params"])} == {np.dtype("float32")}
  assert {x.dtype for x in jax.tree.leaves(state16["opt_state"]) if x.ndim} == {np.dtype("float32")}
  assert "bf16" in hlo16 and "bf16" not in hlo32
  # bf16 keeps 8 bits of mantissa: the first loss agrees to well under 1%.
  np.testing.assert_allclose(loss16, loss32, rtol=5e-3)


def one_device(**overrides):
  """Config, layout, fresh state, train step and first batch on one device (constant learning rate)."""
  config = tiny_config(**{"mesh.data": 1, "schedule.warmup_steps": 0, "schedule.decay": "constant", **overrides})
  layout = plan(config, jax.devices()[:1])
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=0, step=0, batch_size=config.batch_size,
                            seq_len=config.model.max_len, sharding=layout.batch_sharding)
  return config, layout, init_state(layout, config.seed), make_train_step(layout, config), batch


def test_fp16_loss_scaling_skips_overflow_and_recovers_without_a_trace():
  _, _, state, step, batch = one_device(**{"precision.compute": "float16", "precision.loss_scale": 2.0**40})
  initial = jax.device_get(state)
  # 2^40 x the loss overflows float16 in the backward pass: the update is skipped, the scale halves.
  state, metrics = step(state, batch)
  assert int(metrics["skipped"]) == 1 and float(state["loss_scale"]["scale"]) == 2.0**39
  for after, before in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(initial["params"])):
    np.testing.assert_array_equal(after, before)
  overflows = 1
  while int(metrics["skipped"]) == overflows:
    state, metrics = step(state, batch)
    overflows += 1
  overflows -= 1  # the last step went through
  recovered_scale = 2.0**(40 - overflows)
  assert 2.0**5 <= recovered_scale <= 2.0**25, recovered_scale
  # The run that started at the scale that works takes the same single step: skipped steps left nothing behind.
  _, _, fresh, fresh_step, _ = one_device(**{"precision.compute": "float16", "precision.loss_scale": recovered_scale})
  fresh, _ = fresh_step(fresh, batch)
  for recovered, direct in zip(jax.tree.leaves(jax.device_get(state["params"])),
                               jax.tree.leaves(jax.device_get(fresh["params"]))):
    np.testing.assert_array_equal(recovered, direct)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state["opt_state"])))


def test_loss_scale_doubles_after_a_run_of_finite_steps():
  scale = loss_scale.initial(8.0)
  for finite in (True, True):
    scale = loss_scale.update(scale, jnp.bool_(finite), growth_interval=2)
  assert float(scale["scale"]) == 16.0 and int(scale["good_steps"]) == 0
  scale = loss_scale.update(loss_scale.update(scale, jnp.bool_(True), 2), jnp.bool_(False), 2)
  assert float(scale["scale"]) == 8.0 and int(scale["good_steps"]) == 0


def loss_curve(compute, steps=15):
  _, layout, state, step, _ = one_device(**{"precision.compute": compute, "optimizer.lr": 3e-3})
  split = data.open_split(tiny_config().data, "train", vocab_size=256)
  losses = []
  for i in range(steps):
    batch = data.global_batch(split, seed=0, step=i, batch_size=16, seq_len=32, sharding=layout.batch_sharding)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return np.array(losses)


def test_half_precisions_follow_the_fp32_loss_curve():
  fp32 = loss_curve("float32")
  assert fp32[-1] < 0.8 * fp32[0]  # it learns, so the curves have somewhere to diverge
  # Stated tolerance: over 15 steps of the tiny model every loss stays within 2% of fp32's.
  for compute in ("bfloat16", "float16", "float8"):
    np.testing.assert_allclose(loss_curve(compute), fp32, rtol=2e-2, err_msg=compute)


def test_fp8_multiplies_in_e4m3_forward_and_e5m2_backward_over_fp32_masters():
  config, layout, state, step, batch = one_device(**{"precision.compute": "float8"})
  hlo = step.lower(*abstract_inputs(layout, config)).as_text()
  assert "f8E4M3FN" in hlo and "f8E5M2" in hlo
  state, _ = step(state, batch)
  assert {x.dtype for x in jax.tree.leaves(state["params"])} == {np.dtype("float32")}


def test_fp8_einsum_gradients_track_the_exact_ones():
  x = jax.random.normal(jax.random.key(0), (4, 8, 16))
  w = jax.random.normal(jax.random.key(1), (16, 32)) * 0.1
  exact = jax.grad(lambda x, w: jnp.sum(jnp.einsum("btd,df->btf", x, w) ** 2), argnums=(0, 1))(x, w)
  quantized = jax.grad(lambda x, w: jnp.sum(fp8.einsum("btd,df->btf", x, w) ** 2), argnums=(0, 1))(x, w)
  for q, e in zip(quantized, exact):
    # E4M3 keeps 3 mantissa bits and E5M2 two: about 10% per element, far less in the aggregate.
    assert np.linalg.norm(q - e) / np.linalg.norm(e) < 0.1


def test_bf16_moments_halve_the_optimizer_state_and_round_only_storage():
  _, _, state32, step32, batch = one_device()
  _, _, state16, step16, _ = one_device(**{"precision.moments": "bfloat16"})
  moments = [x for x in jax.tree.leaves(state16["opt_state"]) if x.ndim]
  assert {x.dtype for x in moments} == {np.dtype("bfloat16")}
  state32, _ = step32(state32, batch)
  state16, _ = step16(state16, batch)
  # The first update is computed from float32 moments in both runs: identical parameters.
  for a, b in zip(jax.tree.leaves(jax.device_get(state16["params"])), jax.tree.leaves(jax.device_get(state32["params"]))):
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def remat_none():
  return remat_figures("none")


def remat_figures(policy):
  config = tiny_config(**{"mesh.data": 1, "model.remat": policy, "model.num_layers": 4})
  layout = plan(config, jax.devices()[:1])
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=0, step=0, batch_size=config.batch_size,
                            seq_len=config.model.max_len, sharding=layout.batch_sharding)
  temp = analysis.memory_summary(compile_train_step(layout, config))["temp_bytes"]
  return gradients(layout, init_state(layout, config.seed)["params"], batch), temp


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_attention", "offload"])
def test_every_remat_policy_keeps_gradients_and_saves_memory(policy, remat_none):
  (loss, grads), temp = remat_figures(policy)
  (ref_loss, ref_grads), ref_temp = remat_none
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert_tree_close(grads, ref_grads, "gradient")
  assert temp < 0.5 * ref_temp, (temp, ref_temp)


class FakeGpu:
  platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"


@pytest.mark.parametrize("overrides, message", [
    ({"precision.compute": "float64"}, "precision.compute='float64' is unknown"),
    ({"precision.moments": "float16"}, "precision.moments='float16' is unknown"),
    ({"model.remat": "some"}, "model.remat='some' is unknown"),
    ({"precision.compute": "float16", "mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "1f1b"},
     "pipeline.schedule=1f1b differentiates stage by stage"),
])
def test_bad_precision_settings_are_refused_in_one_line(overrides, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    plan(tiny_config(**overrides))


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused():
  cfg = model_config(tiny_config(**{"precision.compute": "float8"}))
  with pytest.raises(ValueError, match=r"needs fp8 tensor cores .* A100-SXM4-80GB has 8\.0"):
    check_backend(cfg, FakeGpu())
