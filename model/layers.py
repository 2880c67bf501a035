"""Parameterised building blocks with logical axis names on every weight."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from model.fp8 import einsum as fp8_einsum

INIT_STD = 0.02  # GPT-2's normal init

ACTIVATIONS = {"gelu": functools.partial(jax.nn.gelu, approximate=True), "silu": jax.nn.silu}


def activation(name: str, x: jax.Array, recompute: bool) -> jax.Array:
  """A feed-forward activation; with `recompute` (model.recompute_activation), recomputed from its input
  in the backward pass.

  Differentiated as written, tanh-GELU keeps three [B, T, mlp] intermediates
  for the backward pass besides its input and output, and SiLU its sigmoid
  (seen in the H200 step's HLO, BENCHMARKS.md). Recomputed, they exist only
  during the layer's backward pass.
  """
  fn = ACTIVATIONS[name]
  return jax.checkpoint(fn)(x) if recompute else fn(x)


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
  if jnp.dtype(dtype) == jnp.float32:
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  return _rounded_einsum(spec, x.astype(dtype), w.astype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounded_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """An einsum whose result, and whose input gradient, leave the matmul in the operands' dtype.

  Each device's matmul still accumulates in float32 (XLA's dots do for bf16
  results) and rounds once. What matters is where: when the contraction is
  split over devices (Megatron's row-parallel output, the column-parallel
  input gradient) the partitioner sums the dot's result across them, so
  rounding inside the dot makes that all-reduce carry bf16, as Megatron-LM's
  does, instead of float32 cast afterwards. The weight gradient keeps a
  float32 result: its sum over the batch's devices stays float32.
  """
  return jnp.einsum(spec, x, w, preferred_element_type=x.dtype)


def _rounded_einsum_fwd(spec, x, w):
  return _rounded_einsum(spec, x, w), (x, w)


def _rounded_einsum_bwd(spec, residuals, g):
  x, w = residuals
  (x_spec, w_spec), out_spec = spec.split("->")[0].split(","), spec.split("->")[1]
  dx = jnp.einsum(f"{out_spec},{w_spec}->{x_spec}", g, w, preferred_element_type=x.dtype)
  dw = jnp.einsum(f"{x_spec},{out_spec}->{w_spec}", x, g, preferred_element_type=jnp.float32)
  return _summed_like(dx, x), _summed_like(dw, w).astype(w.dtype)


def _summed_like(gradient, primal):
  """`gradient` summed over the shard_map axes it varies along and `primal` does not (an expert's weights,
  the same on every `data` shard, take one gradient from all of them): what autodiff inserts for a plain
  einsum, as the transpose of the operand's implicit broadcast, and a custom rule must do itself."""
  extra = jax.typeof(gradient).manual_axis_type.varying - jax.typeof(primal).manual_axis_type.varying
  return jax.lax.psum(gradient, tuple(sorted(extra))) if extra else gradient


_rounded_einsum.defvjp(_rounded_einsum_fwd, _rounded_einsum_bwd)
