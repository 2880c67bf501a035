"""The feed-forward blocks: GPT-2's (up projection, tanh-GELU, down projection) and Llama's SwiGLU."""

import jax
from flax import nnx

from model.config import ModelConfig
from model.layers import INIT_STD, activated_down, matmul, param, zeros
from model.placement import constrain


class Mlp(nnx.Module):
  """Column-parallel up projection then row-parallel down projection (Megatron-LM)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    self.up_kernel = param(rngs, (d, f), ("embed", "mlp"))
    self.up_bias = zeros((f,), ("mlp",))
    self.down_kernel = param(rngs, (f, d), ("mlp", "embed"), std=INIT_STD / (2 * cfg.num_layers) ** 0.5)
    self.down_bias = zeros((d,), ("embed",))
    self.cfg = cfg

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    cfg, dtype = self.cfg, self.cfg.dtype
    h_BTF = matmul("btd,df->btf", x_BTD, self.up_kernel[...], dtype, cfg.fp8) + self.up_bias[...].astype(dtype)
    y_BTD = activated_down("gelu", _down(self.down_kernel[...], cfg), cfg, h_BTF)
    return y_BTD + self.down_bias[...].astype(dtype)


class SwiGLU(nnx.Module):
  """silu(x W_gate) * (x W_up), then W_down: gate and up column parallel, down row parallel."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    self.gate_kernel = param(rngs, (d, f), ("embed", "mlp"))
    self.up_kernel = param(rngs, (d, f), ("embed", "mlp"))
    self.down_kernel = param(rngs, (f, d), ("mlp", "embed"), std=INIT_STD / (2 * cfg.num_layers) ** 0.5)
    self.cfg = cfg

  def __call__(self, x_BTD):
    cfg, dtype = self.cfg, self.cfg.dtype
    gate_BTF = matmul("btd,df->btf", x_BTD, self.gate_kernel[...], dtype, cfg.fp8)
    up_BTF = matmul("btd,df->btf", x_BTD, self.up_kernel[...], dtype, cfg.fp8)
    return activated_down("silu", _down(self.down_kernel[...], cfg), cfg, gate_BTF, up_BTF)


def _down(kernel_FD: jax.Array, cfg: ModelConfig):
  """The row-parallel down projection of an activated [B, T, mlp] value, its input placed as the mlp axis is."""
  return lambda h_BTF: matmul("btf,fd->btd", constrain(h_BTF, ("batch", "length", "mlp")), kernel_FD, cfg.dtype,
                              cfg.fp8)
