"""The GPT-2 feed-forward block: up projection, tanh-GELU, down projection."""

import jax
from flax import nnx

from model.config import ModelConfig
from model.layers import INIT_STD, activation, matmul, param, zeros
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
    dtype = self.cfg.dtype
    h_BTF = matmul("btd,df->btf", x_BTD, self.up_kernel[...], dtype, self.cfg.fp8) + self.up_bias[...].astype(dtype)
    h_BTF = constrain(activation("gelu", h_BTF, self.cfg.recompute_activation), ("batch", "length", "mlp"))
    return matmul("btf,fd->btd", h_BTF, self.down_kernel[...], dtype, self.cfg.fp8) + self.down_bias[...].astype(dtype)
