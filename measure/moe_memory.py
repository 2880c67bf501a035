"""One MoE layer's forward and backward compiled ahead of time on one device, allocating nothing: XLA's
temporary bytes, and its FLOPs per token against 6 N, N the active parameters a token uses (tools/moe_memory.py
prints them against sequence length)."""

import jax
import jax.numpy as jnp
from flax import nnx

from measure import analysis
from model.config import ModelConfig
from model.moe import AUX_LOSS, MoE


def layer_config(family="gpt2", embed=768, mlp=3072, experts=8, top_k=2, capacity_factor=1.0,
                 dropless=False) -> ModelConfig:
  return ModelConfig(family=family, num_layers=1, num_heads=1, embed_dim=embed, mlp_dim=mlp, max_len=1,
                     vocab_size=1, num_experts=experts, moe_top_k=top_k, moe_capacity_factor=capacity_factor,
                     moe_dropless=dropless)


def compile_layer(cfg: ModelConfig, length: int):
  """The compiled gradient of the layer's summed output and auxiliary loss, for one sequence."""
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(params=0))))

  def loss(params, x_BTD):
    y_BTD, stats = nnx.merge(graphdef, params)(x_BTD, jnp.arange(length))
    return y_BTD.sum() + stats[AUX_LOSS]

  x_BTD = jax.ShapeDtypeStruct((1, length, cfg.embed_dim), jnp.float32)
  return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x_BTD).compile()


def active_params_per_token(cfg: ModelConfig) -> int:
  """The weights one token multiplies: k experts of 2 (GELU) or 3 (SwiGLU) matmuls, and the router."""
  matmuls = 3 if cfg.traits.gated_mlp else 2
  return cfg.moe_top_k * matmuls * cfg.embed_dim * cfg.mlp_dim + cfg.embed_dim * cfg.num_experts


def measure(cfg: ModelConfig, length: int) -> tuple[int, float]:
  """(temporary bytes, compiled FLOPs per token / 6 N) of the layer's forward and backward."""
  compiled = compile_layer(cfg, length)
  flops_per_token = compiled.cost_analysis()["flops"] / length
  return analysis.memory_summary(compiled)["temp_bytes"], flops_per_token / (6 * active_params_per_token(cfg))
