"""LayerNorm and RMSNorm (model/layers.py layer_norm, rms_norm): a hand-written backward pass that keeps
only the input and each row's float32 statistics, against autodiff of the float32 formula it replaces."""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AxisType, PartitionSpec as P
from jax import test_util

from helpers import LLAMA, make_train_step, setup, tiny_config
from model import gpt2, layers, llama
from training.state import model_config

EPS = 1e-5


def reference(x, scale, bias, eps):
  """The normalisation as the modules wrote it before: float32 throughout, differentiated by autodiff."""
  axes = tuple(range(-scale.ndim, 0))
  x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  if bias is not None:
    x32 = x32 - x32.mean(axes, keepdims=True)
  y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(axes, keepdims=True) + eps) * scale
  return (y if bias is None else y + bias).astype(x.dtype)


def norm(kind):
  """The function under test as (x, scale, bias) -> y; RMSNorm ignores the bias."""
  if kind == "layer":
    return lambda x, s, b: layers.layer_norm(x, s, b, EPS)
  return lambda x, s, b: layers.rms_norm(x, s, EPS)


def norm_reference(kind):
  return lambda x, s, b: reference(x, s, b if kind == "layer" else None, EPS)


def inputs(dtype, scale_shape=(64,), seed=0):
  """x with a nonzero mean per row, scale and bias near GPT-2's, and a cotangent to pull back."""
  kx, ks, kb, kg = jax.random.split(jax.random.key(seed), 4)
  x = (jax.random.normal(kx, (2, 8, *scale_shape)) * 2 + 0.5).astype(dtype)
  scale = 1 + 0.1 * jax.random.normal(ks, scale_shape)
  bias = 0.1 * jax.random.normal(kb, scale_shape)
  g = jax.random.normal(kg, x.shape).astype(dtype)
  return x, scale, bias, g


def pullback(fn, x, scale, bias, g):
  """Gradients of <fn(x, scale, bias), g> by x, scale and bias, as float32 numpy arrays."""
  grads = jax.grad(lambda *a: jnp.vdot(fn(*a).astype(jnp.float32), g.astype(jnp.float32)), argnums=(0, 1, 2))(
      x, scale, bias)
  return [np.asarray(d, np.float32) for d in grads]


def relative_error(actual, expected):
  return np.abs(actual - expected).max() / np.abs(expected).max()


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("scale_shape", [(64,), (4, 16)], ids=["last-axis", "two-axes"])
def test_gradients_equal_autodiff_of_the_float32_formula(kind, dtype, tolerance, scale_shape):
  # Two axes: OLMoE's query and key norms, over heads x head_dim together.
  x, scale, bias, g = inputs(dtype, scale_shape)
  np.testing.assert_allclose(np.asarray(norm(kind)(x, scale, bias), np.float32),
                             np.asarray(norm_reference(kind)(x, scale, bias), np.float32),
                             rtol=tolerance, atol=tolerance)
  expected = pullback(norm_reference(kind), x, scale, bias, g)
  for name, a, e in zip(("x", "scale", "bias"), pullback(norm(kind), x, scale, bias, g), expected):
    if kind == "rms" and name == "bias":
      assert not a.any() and not e.any()  # RMSNorm has no bias: the argument is unused
    else:
      assert relative_error(a, e) < tolerance, (kind, name, relative_error(a, e))
  assert jax.grad(lambda x: norm(kind)(x, scale, bias).sum())(x).dtype == dtype


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gradients_pass_a_numerical_check_in_float64(kind):
  # Second order too: the backward pass is itself plain jax, so it can be differentiated again.
  with jax.enable_x64(True):
    x, scale, bias, _ = inputs(jnp.float64, (16,))
    scale, bias = scale.astype(jnp.float64), bias.astype(jnp.float64)
    test_util.check_grads(norm(kind), (x, scale, bias), order=2, modes=["rev"])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gradients_inside_shard_map_sum_the_parameters_over_the_shards(kind):
  # Each shard holds a quarter of the positions (as context parallelism splits them) and the whole scale and
  # bias, the same on every shard: their gradients are the sum over the shards, which autodiff adds by itself
  # and the custom rule must add by hand.
  x, scale, bias, g = inputs(jnp.float32)
  mesh = jax.make_mesh((4,), ("rows",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])  # as parallel/mesh.py
  objective = lambda x, s, b, g: jnp.vdot(norm(kind)(x, s, b), g)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "rows"), P(), P(), P(None, "rows")),
                     out_specs=(P(None, "rows"), P(), P()))
  def sharded(x, s, b, g):
    return jax.grad(lambda *a: jax.lax.psum(objective(*a, g), "rows"), argnums=(0, 1, 2))(x, s, b)

  expected = jax.grad(objective, argnums=(0, 1, 2))(x, scale, bias, g)
  for a, e in zip(jax.jit(sharded)(x, scale, bias, g), expected):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family, block", [("gpt2", gpt2.Block), ("llama", llama.Block)])
def test_a_bf16_block_saves_no_float32_copy_of_its_activations(family, block):
  # Differentiated as written, the norms kept float32 [B, T, D] values, each LayerNorm three (x - mean, the
  # factor 2 of its square's derivative, and the normalised x). Now each norm keeps its bfloat16 input and
  # float32 [B, T, 1] statistics: LayerNorm the mean and 1 / deviation, RMSNorm the latter.
  cfg = model_config(tiny_config(**{"precision.compute": "bfloat16", "model.family": family,
                                    **(LLAMA if family == "llama" else {})}))
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(block(cfg, nnx.Rngs(0)))
  residuals = io.StringIO()
  with contextlib.redirect_stdout(residuals):
    print_saved_residuals(lambda p, x: nnx.merge(graphdef, p)(x, jnp.arange(32))[0], params,
                          jnp.zeros((2, 32, cfg.embed_dim), jnp.bfloat16))
  listed = residuals.getvalue()
  assert f"f32[2,32,{cfg.embed_dim}]" not in listed, listed
  assert listed.count("f32[2,32,1]") == {"gpt2": 4, "llama": 2}[family], listed


def test_the_compiled_step_holds_fewer_temporaries_than_autodiff_of_the_formula(monkeypatch):
  # A bf16 GPT-2 of 2 layers at B x T = 512: at least 8 bfloat16 [B, T, D] fewer per layer (measured
  # here: 12.0, the six float32 values autodiff kept, each two such units).
  overrides = {"precision.compute": "bfloat16", "model.num_layers": 2, "model.embed_dim": 128, "model.mlp_dim": 512}

  def temporaries():
    config, layout, state, batch = setup(overrides, jax.devices()[:1])
    return make_train_step(layout, config).lower(state, batch).compile().memory_analysis().temp_size_in_bytes

  config = tiny_config(**overrides)
  unit = config.batch_size * config.model.max_len * config.model.embed_dim * 2  # one bf16 [B, T, D]
  custom = temporaries()
  monkeypatch.setattr(layers, "_norm", reference)
  autodiff = temporaries()
  assert autodiff - custom >= 8 * unit * config.model.num_layers, (autodiff, custom, (autodiff - custom) / unit)
