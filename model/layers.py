"""Parameterised building blocks with logical axis names on every weight."""

import jax
import jax.numpy as jnp
from flax import nnx

from model.fp8 import einsum as fp8_einsum

INIT_STD = 0.02  # GPT-2's normal init


def param(rngs: nnx.Rngs, shape, axes, std=INIT_STD) -> nnx.Param:
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std, out_sharding=axes)


def vocab_param(rngs: nnx.Rngs, shape, axes, vocab_size: int) -> nnx.Param:
  """param() over the padded vocabulary, zero past vocab_size on the `vocab` axis.

  No token id reaches the padding and the loss masks it, so it never gets a gradient: zero
  rows stay zero, which is what an exported checkpoint (and its truncation) assumes.
  """
  vocab_axis = axes.index("vocab")
  real = jnp.arange(shape[vocab_axis]) < vocab_size
  real = real.reshape([-1 if axis == vocab_axis else 1 for axis in range(len(shape))])
  values = jnp.where(real, jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD, 0.0)
  return nnx.Param(values, out_sharding=axes)


def zeros(shape, axes) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=axes)


def ones(shape, axes) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, jnp.float32), out_sharding=axes)


class LayerNorm(nnx.Module):
  """Pre-LN normalisation, always computed in float32."""

  def __init__(self, dim: int, eps: float = 1e-5):
    self.scale = ones((dim,), ("embed",))
    self.bias = zeros((dim,), ("embed",))
    self.eps = eps

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    x = x_BTD.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...] + self.bias[...]).astype(x_BTD.dtype)


def matmul(spec: str, x: jax.Array, w: jax.Array, dtype, fp8: bool = False) -> jax.Array:
  """einsum in the compute dtype accumulating in float32; with `fp8`, on fp8 operands (model/fp8.py)."""
  if fp8:
    return fp8_einsum(spec, x.astype(dtype), w.astype(dtype))
  out = jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  return out.astype(dtype)
