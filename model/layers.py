"""Parameterised building blocks with logical axis names on every weight."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.fp8 import einsum as fp8_einsum
from model.fp8 import fixed_scale_einsum, head_scales

INIT_STD = 0.02  # GPT-2's normal init

# model/config.py ACTIVATION_NAMES lists these for validation; relu2, ReLU squared (So et al., "Primer", 2021), is
# the modded-nanogpt speedrun's.
ACTIVATIONS = {"gelu": functools.partial(jax.nn.gelu, approximate=True), "silu": jax.nn.silu,
               "relu2": lambda h: jnp.square(jax.nn.relu(h))}


def activated_down(name: str, down, cfg: ModelConfig, h: jax.Array, up: jax.Array | None = None) -> jax.Array:
  """down(act(h)), or down(act(h) * up) for a gated unit (SwiGLU): a feed-forward layer's second half.

  With model.recompute_activation, the backward pass keeps only h (and up) and makes act(h), act'(h) and
  the down projection's input again from them. Differentiated as written, the layer keeps four more
  [B, T, mlp] values: tanh-GELU's three intermediates and its output (seen in the H200 step's HLO,
  BENCHMARKS.md), or three of SiLU's and the gated product. The recomputation is pointwise work on values
  the backward pass reads anyway; the down matmul is not run again, its output being of no use there.

  Under model.scan_layers the layer runs in a loop whose backward pass is another loop, where XLA cannot
  merge the recomputation with the forward pass's: jax's guard against that (prevent_cse) would only cost
  temporaries there. Unrolled, the guard is what keeps act(h) from living until the backward pass.
  """
  def second_half(h, *up):
    activated = ACTIVATIONS[name](h)
    return down(activated * up[0] if up else activated)
  operands = (h,) if up is None else (h, up)
  if not cfg.recompute_activation:
    return second_half(*operands)
  return jax.checkpoint(second_half, prevent_cse=not cfg.scan_layers)(*operands)


def out_projection_std(cfg: ModelConfig) -> float:
  """The initial spread of a projection back into the residual stream (the attention's output, the MLP's down):
  GPT-2's 1/sqrt(2L) of the others', so the stream's variance stays put; 0 with model.zero_init_out (the speedrun's
  zero-initialised projections: each block starts as the identity)."""
  return 0.0 if cfg.zero_init_out else INIT_STD / (2 * cfg.num_layers) ** 0.5


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
    return layer_norm(x_BTD, self.scale[...], self.bias[...], self.eps)


class RMSNorm(nnx.Module):
  """Root-mean-square normalisation over the last axis (`axis`, its logical name), in float32."""

  def __init__(self, dim: int, eps: float = 1e-6, axis: str = "embed"):
    self.scale = ones((dim,), (axis,))
    self.eps = eps

  def __call__(self, x_BTD):
    return rms_norm(x_BTD, self.scale[...], self.eps)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """(x - mean) / sqrt(var + eps) * scale + bias over x's last scale.ndim axes, in float32, returned in x's dtype."""
  return _norm(x, scale, bias, eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) * scale over x's last scale.ndim axes, in float32, returned in x's dtype."""
  return _norm(x, scale, None, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm(x, scale, bias, eps):
  """LayerNorm (with a bias) or RMSNorm (bias None), differentiated by hand.

  Autodiff of the float32 formula keeps three float32 values as large as x for
  each LayerNorm (x - mean, the square's derivative 2(x - mean), the normalised
  x): 12 of the 38 bfloat16 [B, T, D] units a GPT-2 layer kept (BENCHMARKS.md).
  The backward pass below needs only x as it came in and each row's statistics,
  and recomputes the normalised x from them.
  """
  return _norm_forward(x, scale, bias, eps)[0]


def _norm_forward(x, scale, bias, eps):
  axes = tuple(range(-scale.ndim, 0))
  x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # float64 stays so: the tests' numerical check
  mean = None if bias is None else x32.mean(axes, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.square(_centred(x32, mean)).mean(axes, keepdims=True) + eps)
  y = _centred(x32, mean) * rstd * scale
  return (y if bias is None else y + bias).astype(x.dtype), (x, mean, rstd, scale, bias)


def _norm_backward(eps, residuals, g):
  x, mean, rstd, scale, bias = residuals
  axes, rows = tuple(range(-scale.ndim, 0)), tuple(range(x.ndim - scale.ndim))
  x_hat = _centred(x.astype(rstd.dtype), mean) * rstd
  g = g.astype(rstd.dtype)
  gs = g * scale
  # d/dx of x_hat is rstd times the projection that removes what the row's statistics absorb: the
  # mean of the incoming gradient (LayerNorm only) and its component along x_hat.
  dx = gs - x_hat * (gs * x_hat).mean(axes, keepdims=True)
  if mean is not None:
    dx = dx - gs.mean(axes, keepdims=True)
  dscale = _summed_like((g * x_hat).sum(rows), scale).astype(scale.dtype)
  dbias = None if bias is None else _summed_like(g.sum(rows), bias).astype(bias.dtype)
  return _summed_like(dx * rstd, x).astype(x.dtype), dscale, dbias


def _centred(x, mean):
  return x if mean is None else x - mean


_norm.defvjp(_norm_forward, _norm_backward)


def soft_capped(x: jax.Array, cap: float) -> jax.Array:
  """cap x tanh(x / cap) in float32: bounded by +-cap, near x well below it (Gemma 2's soft-capping of
  attention scores and logits); x unchanged where `cap` is 0."""
  return cap * jnp.tanh(x.astype(jnp.float32) / cap) if cap else x


def matmul(spec: str, x: jax.Array, w: jax.Array, dtype, fp8: bool = False) -> jax.Array:
  """einsum in the compute dtype accumulating in float32; with `fp8`, on fp8 operands (model/fp8.py)."""
  if fp8:
    return fp8_einsum(spec, x.astype(dtype), w.astype(dtype))
  if jnp.dtype(dtype) == jnp.float32:
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  return _rounded_einsum(spec, x.astype(dtype), w.astype(dtype))


def head_matmul(spec: str, x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
  """The head's matmul: as `matmul` in the compute dtype (precision.compute=float8 included: its head stays
  bfloat16), or with model.fp8_head in fp8 at the speedrun's fixed scales (model/fp8.py fixed_scale_einsum)."""
  if cfg.fp8_head:
    return fixed_scale_einsum(spec, x.astype(cfg.dtype), w.astype(cfg.dtype), head_scales(cfg.embed_dim))
  return matmul(spec, x, w, cfg.dtype)


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
