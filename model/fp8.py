"""fp8 matrix multiplies with per-tensor current scaling: E4M3 forward, E5M2 gradients.

Each operand is scaled so its largest magnitude lands on the format's largest
finite value, cast to fp8, multiplied with float32 accumulation, and the
product unscaled. The forward operands use E4M3 (more mantissa); the incoming
gradient uses E5M2 (more range), as in NVIDIA Transformer Engine's hybrid
recipe. Scales come from the current tensors ("current scaling") rather than
an amax history, so no scaling state is carried between steps.

`fixed_scale_einsum` is the modded-nanogpt speedrun's fp8 head (model.fp8_head): scales fixed in advance from
what the operands can hold, so no maximum is taken over a tensor (which, split over devices, would cost a
reduction), and each entry's rounding depends on that entry alone.
"""

import functools

import jax
import jax.numpy as jnp

FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x, fp8_dtype):
  """(x scaled into fp8, the factor that undoes the scaling)."""
  amax = jax.lax.stop_gradient(jnp.max(jnp.abs(x)).astype(jnp.float32))
  scale = float(jnp.finfo(fp8_dtype).max) / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny)
  return (x.astype(jnp.float32) * scale).astype(fp8_dtype), 1.0 / scale


def _product(spec, a, a_unscale, b, b_unscale, dtype):
  return (jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * (a_unscale * b_unscale)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(spec: str, x, w):
  """jnp.einsum(spec, x, w) for a two-operand spec whose every input index is in the output or the other operand."""
  return _forward(spec, x, w)[0]


def _forward(spec, x, w):
  (xq, x_unscale), (wq, w_unscale) = quantize(x, FORWARD), quantize(w, FORWARD)
  return _product(spec, xq, x_unscale, wq, w_unscale, x.dtype), (xq, x_unscale, wq, w_unscale)


def _backward(spec, saved, g):
  xq, x_unscale, wq, w_unscale = saved  # x, w and g share the compute dtype (model/layers.py matmul)
  inputs, out = spec.split("->")
  x_axes, w_axes = inputs.split(",")
  gq, g_unscale = quantize(g, BACKWARD)
  dx = _product(f"{out},{w_axes}->{x_axes}", gq, g_unscale, wq, w_unscale, g.dtype)
  dw = _product(f"{x_axes},{out}->{w_axes}", xq, x_unscale, gq, g_unscale, g.dtype)
  return dx, dw


einsum.defvjp(_forward, _backward)


def head_scales(embed_dim: int) -> tuple[float, float, float]:
  """The fp8 head's fixed scales (the input's, the weight's, the logits' gradient's), modded-nanogpt's: 448 is E4M3's
  largest value, the input is normalised (no entry beyond sqrt(width) at unit gain), and each position's gradient
  of the summed loss (softmax - one-hot) lies within [-1, 1]."""
  return embed_dim ** 0.5 / 448, 24 / 448, 1 / 448


def _clipped(x, unscale: float, fp8_dtype):
  """x / unscale in fp8, saturated at the format's largest value (an fp8 cast past it would be NaN)."""
  largest = float(jnp.finfo(fp8_dtype).max)
  return jnp.clip(x.astype(jnp.float32) / unscale, -largest, largest).astype(fp8_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fixed_scale_einsum(spec: str, x, w, scales: tuple[float, float, float]):
  """einsum as `einsum` does it, the operands and the incoming gradient scaled by the fixed `scales` (head_scales)."""
  return _fixed_forward(spec, x, w, scales)[0]


def _fixed_forward(spec, x, w, scales):
  x_unscale, w_unscale, _ = scales
  xq, wq = _clipped(x, x_unscale, FORWARD), _clipped(w, w_unscale, FORWARD)
  return _product(spec, xq, x_unscale, wq, w_unscale, x.dtype), (xq, wq)


def _fixed_backward(spec, scales, saved, g):
  (xq, wq), (x_unscale, w_unscale, g_unscale) = saved, scales
  inputs, out = spec.split("->")
  x_axes, w_axes = inputs.split(",")
  gq = _clipped(g, g_unscale, BACKWARD)
  dx = _product(f"{out},{w_axes}->{x_axes}", gq, g_unscale, wq, w_unscale, g.dtype)
  dw = _product(f"{x_axes},{out}->{w_axes}", xq, x_unscale, gq, g_unscale, g.dtype)
  return dx, dw


fixed_scale_einsum.defvjp(_fixed_forward, _fixed_backward)
