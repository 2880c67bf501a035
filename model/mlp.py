"""The feed-forward layer, as the family's traits shape it: GPT-2's (up projection with biases, tanh-GELU, down
projection) or Llama's SwiGLU (silu(x W_gate) * x W_up, then W_down). `feed_forward` is the one place the
activation and gate are applied, for the dense layer here and for each expert of model/moe.py."""

import jax
from flax import nnx

from model.config import ModelConfig
from model.layers import activated_down, matmul, out_projection_std, param, zeros
from model.placement import constrain


def weight_names(cfg: ModelConfig) -> tuple[str, ...]:
  """The feed-forward weights of cfg's family, in the order feed_forward takes them: a gate where the family
  is gated, biases where it has them."""
  gate, biases = cfg.traits.gated_mlp, cfg.traits.biases
  return (*("gate_kernel",) * gate, "up_kernel", *("up_bias",) * biases, "down_kernel", *("down_bias",) * biases)


def feed_forward(cfg: ModelConfig, x, weights: tuple, project, project_down, bias):
  """act(x W_up + b_up) W_down + b_down, or gated act(x W_gate) * (x W_up) W_down, on a dense layer's tokens or an
  expert's: `weights` are weight_names(cfg)'s arrays, `project(x, kernel)` and `project_down(h, kernel)` the
  layer's matmuls into and out of the mlp width, and `bias(b)` lays a bias out as their outputs are."""
  named = dict(zip(weight_names(cfg), weights))
  gate = (project(x, named["gate_kernel"]),) if cfg.traits.gated_mlp else ()
  up = project(x, named["up_kernel"])
  if cfg.traits.biases:
    up = up + bias(named["up_bias"])  # what the backward pass keeps of an ungated layer (activated_down)
  y = activated_down(cfg.mlp_activation, lambda h: project_down(h, named["down_kernel"]), cfg, *gate, up)
  return y + bias(named["down_bias"]) if cfg.traits.biases else y


class Mlp(nnx.Module):
  """The family's dense feed-forward layer: gate and up projections column parallel, down row parallel
  (Megatron-LM)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    if cfg.traits.gated_mlp:
      self.gate_kernel = param(rngs, (d, f), ("embed", "mlp"))
    self.up_kernel = param(rngs, (d, f), ("embed", "mlp"))
    self.down_kernel = param(rngs, (f, d), ("mlp", "embed"), std=out_projection_std(cfg))
    if cfg.traits.biases:
      self.up_bias = zeros((f,), ("mlp",))
      self.down_bias = zeros((d,), ("embed",))
    self.cfg = cfg

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    cfg, dtype = self.cfg, self.cfg.dtype
    weights = tuple(getattr(self, name)[...] for name in weight_names(cfg))
    up = lambda x_BTD, kernel_DF: matmul("btd,df->btf", x_BTD, kernel_DF, dtype, cfg.fp8)
    # The down projection's input placed as the mlp axis is.
    down = lambda h_BTF, kernel_FD: matmul("btf,fd->btd", constrain(h_BTF, ("batch", "length", "mlp")), kernel_FD,
                                           dtype, cfg.fp8)
    return feed_forward(cfg, x_BTD, weights, up, down, lambda bias: bias.astype(dtype))
