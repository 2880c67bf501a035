"""Precision policies (fp32, bf16, fp16 with loss scaling, fp8; bf16 moments) and remat policies."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from helpers import assert_tree_close, batch_at, fresh_state, gradients, read_metrics, tiny_config
from measure import analysis
from model import fp8
from parallel.checks import check_backend
from input_pipeline import data
from run.loop import train
from training import loss_scale
from training.state import abstract_inputs, model_config, plan
from training.step import compile_train_step, make_train_step


def first_step(compute):
  config = tiny_config(**{"precision.compute": compute, "mesh.data": 4, "mesh.tensor": 2})
  layout = plan(config)
  state = fresh_state(layout, config.seed)
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
  return config, layout, fresh_state(layout, config.seed), make_train_step(layout, config), batch


def test_fp16_loss_scaling_skips_overflow_and_recovers_without_a_trace():
  _, _, state, step, batch = one_device(**{"precision.compute": "float16", "precision.loss_scale": 2.0**40})
  initial = jax.device_get(state)
  # 2^40 x the loss overflows float16 in the backward pass: the update is dropped and the scale halves,
  # the scaler's routine, so `skipped` (what nonfinite= acts on) does not count it.
  state, metrics = step(state, batch)
  assert int(metrics["skipped"]) == 0 and float(state["loss_scale"]["scale"]) == 2.0**39
  for after, before in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(initial["params"])):
    np.testing.assert_array_equal(after, before)
  overflows = 1
  while float(state["loss_scale"]["scale"]) < float(metrics["loss_scale"]):  # halved: overflowed again
    state, metrics = step(state, batch)
    overflows += 1
  overflows -= 1  # the last step went through
  assert int(metrics["skipped"]) == 0
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


# compute dtype -> (unit roundoff 2^-p of its p-bit significand, the whole curve's tolerance). float8's
# is E4M3's, in which its weight matmuls take their inputs.
ROUNDOFF_AND_CURVE_TOLERANCE = {"bfloat16": (2.0**-8, 1e-2), "float16": (2.0**-11, 4e-3),
                                "float8": (2.0**-4, 1.5e-2)}


def test_half_precisions_follow_the_fp32_loss_curve():
  fp32 = loss_curve("float32")
  assert fp32[-1] < 0.8 * fp32[0]  # it learns, so the curves have somewhere to diverge
  tokens = 16 * 32
  for compute, (roundoff, curve_tolerance) in ROUNDOFF_AND_CURVE_TOLERANCE.items():
    losses = loss_curve(compute)
    # The first loss is the forward pass alone from the same weights: the rounding errors, at most u
    # relative per value, average over the batch's 512 per-token losses to about u / sqrt(512).
    np.testing.assert_allclose(losses[0], fp32[0], rtol=roundoff / np.sqrt(tokens), err_msg=compute)
    # Later losses also follow weights trained on rounded gradients, and the runs drift apart (here
    # to 0.54% for bfloat16, 0.23% for float16 and 1.1% for float8 by step 15): each tolerance is
    # 1.4 to 1.9 times its drift, in the order of the formats' precision, where a flat 2% was 1.8 to 8.7
    # times it.
    np.testing.assert_allclose(losses, fp32, rtol=curve_tolerance, err_msg=compute)


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
  # Rounding to a p-bit significand (E4M3: p = 4, E5M2: p = 3) leaves an error uniform over one spacing,
  # 2^(1-p) x 2^e for a value in [2^e, 2^(e+1)): RMS 2^(1-p) / sqrt(12) of 2^e, about 2^(1-p) / (1.5 x 3.46)
  # of a value mid-range: 2.4% for E4M3 and 4.8% for E5M2. Each gradient is a product of an E5M2 gradient
  # and an E4M3 operand: sqrt(4.8^2 + 2.4^2) = 5.4% in the aggregate (4.9% here).
  for q, e in zip(quantized, exact):
    assert np.linalg.norm(q - e) / np.linalg.norm(e) < 0.06


def test_bf16_moments_halve_the_optimizer_state_and_round_only_storage():
  config, layout16, state16, step16, _ = one_device(**{"precision.moments": "bfloat16"})
  _, layout32, _, step32, _ = one_device()
  assert {x.dtype for x in jax.tree.leaves(state16["opt_state"]) if x.ndim} == {np.dtype("bfloat16")}
  for i in range(2):  # past step 1, whose update starts from zero moments, which no rounding touches
    state16, _ = step16(state16, batch_at(config, layout16, i))
  before = jax.device_get(state16)
  widened = {**before, "opt_state": jax.tree.map(
      lambda x: x.astype(np.float32) if x.dtype == jnp.bfloat16 else x, before["opt_state"])}
  # Step 3 from the same (non-zero) moments, once as bfloat16 storage and once held in float32 throughout.
  batch = batch_at(config, layout16, 2)
  after16 = jax.device_get(step16(jax.device_put(before, layout16.state_shardings), batch)[0])
  after32 = jax.device_get(step32(jax.device_put(widened, layout32.state_shardings), batch)[0])
  # The update is float32 arithmetic on the widened moments: the same parameters, bit for bit.
  params32 = jax.tree.leaves(after32["params"])
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(after16["params"]), params32):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  # Only what is stored is rounded: the new moments are the float32 ones rounded to bfloat16.
  moments16 = [x for x in jax.tree.leaves(after16["opt_state"]) if x.ndim]
  moments32 = [x for x in jax.tree.leaves(after32["opt_state"]) if x.ndim]
  assert {x.dtype for x in moments16} == {np.dtype("bfloat16")}
  rounded = [np.asarray(jnp.asarray(x).astype(jnp.bfloat16)) for x in moments32]
  assert any((r.astype(np.float32) != x).any() for r, x in zip(rounded, moments32))  # so rounding shows
  for a, r in zip(moments16, rounded):
    np.testing.assert_array_equal(a, r)


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
  return gradients(layout, fresh_state(layout, config.seed)["params"], batch), temp


@pytest.mark.parametrize("policy", ["full", "full_offload", "save_dots", "save_attention", "offload"])
def test_every_remat_policy_keeps_gradients_and_saves_memory(policy, remat_none):
  (loss, grads), temp = remat_figures(policy)
  (ref_loss, ref_grads), ref_temp = remat_none
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert_tree_close(grads, ref_grads, "gradient")
  # Under `none` the MLP keeps only its pre-activation (model.recompute_activation), so save_dots, which
  # keeps every matmul's output, saves the least: 0.55 of none's temporaries on this 4-layer model.
  assert temp < 0.6 * ref_temp, (temp, ref_temp)


def host_values(jaxpr):
  """(shape, dtype) of every value a jaxpr, or one nested in it, places in host memory."""
  for eqn in jaxpr.eqns:
    yield from ((v.aval.shape, v.aval.dtype) for v in eqn.outvars
                if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host)
    for inner in jax_core.jaxprs_in_params(eqn.params):
      yield from host_values(inner)


def test_full_offload_keeps_the_block_inputs_in_host_memory():
  # The CPU's host memory is its device memory, so the compiled sizes cannot show the move: the
  # traced step can. The residuals of the layer scan are the stacked block inputs, in host memory.
  config = tiny_config(**{"mesh.data": 1, "model.remat": "full_offload", "model.num_layers": 4})
  layout = plan(config, jax.devices()[:1])
  jaxpr = jax.make_jaxpr(make_train_step(layout, config))(*abstract_inputs(layout, config)).jaxpr
  stacked = (4, config.batch_size, config.model.max_len, config.model.embed_dim)
  assert (stacked, np.dtype("float32")) in set(host_values(jaxpr))


class FakeGpu:
  platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"


@pytest.mark.parametrize("overrides, message", [
    ({"precision.compute": "float64"}, "precision.compute='float64' is unknown"),
    ({"precision.moments": "float16"}, "precision.moments='float16' is unknown"),
    ({"model.remat": "some"}, "model.remat='some' is unknown"),
])
def test_bad_precision_settings_are_refused_in_one_line(overrides, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    plan(tiny_config(**overrides))


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused():
  cfg = model_config(tiny_config(**{"precision.compute": "float8"}))
  with pytest.raises(ValueError, match=r"needs fp8 tensor cores .* A100-SXM4-80GB has 8\.0"):
    check_backend(cfg, FakeGpu())


def test_fp16_runs_log_the_loss_scale(tmp_path, capsys):
  config = tiny_config(**{"precision.compute": "float16", "precision.loss_scale": 2.0**40, "steps": 2,
                          "log_every": 1, "eval_every": 0, "sample_tokens": 0, "workdir": str(tmp_path)})
  train(config)
  logged = read_metrics(tmp_path)
  # 2^40 overflows float16 in the backward pass, so each step is skipped and the scale halves.
  assert [m["loss_scale"] for m in logged] == [2.0**40, 2.0**39]
  assert "loss_scale 549755813888" in capsys.readouterr().out
