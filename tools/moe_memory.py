"""Compiled temporaries and FLOPs of one MoE layer's forward and backward against sequence length.

  python tools/moe_memory.py --lengths 256,512,1024,2048,4096
  python tools/moe_memory.py --dropless

Compiles ahead of time on one device, allocating nothing: one sequence (one
routing group) through a GPT-2-small-sized MoE layer (8 experts, top 2, or
--family=llama for SwiGLU experts), gradients of its inputs and weights. Prints
XLA's temporary bytes, and its FLOP count per token against 6 N, N the
active parameters a token uses: k experts' matmuls and the router.
"""

import sys
from pathlib import Path

# `python tools/moe_memory.py` puts tools/ on sys.path, not the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position

from measure import analysis  # pylint: disable=wrong-import-position
from model.config import ModelConfig  # pylint: disable=wrong-import-position
from model.families import FAMILIES  # pylint: disable=wrong-import-position
from model.moe import AUX_LOSS, MoE  # pylint: disable=wrong-import-position

_LENGTHS = flags.DEFINE_list("lengths", ["256", "512", "1024", "2048", "4096"], "Sequence lengths.")
_FAMILY = flags.DEFINE_enum("family", "gpt2", list(FAMILIES), "GELU experts (gpt2) or SwiGLU (llama).")
_EMBED = flags.DEFINE_integer("embed", 768, "Model width D.")
_MLP = flags.DEFINE_integer("mlp", 3072, "Expert hidden width F.")
_EXPERTS = flags.DEFINE_integer("experts", 8, "Experts E.")
_TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token k.")
_CAPACITY = flags.DEFINE_float("capacity_factor", 1.0, "Slots per expert in units of the fair share k T / E.")
_DROPLESS = flags.DEFINE_bool("dropless", False, "Every choice kept: the grouped matmuls (ragged_dot).")


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


def main(argv):
  del argv
  cfg = layer_config(_FAMILY.value, _EMBED.value, _MLP.value, _EXPERTS.value, _TOP_K.value, _CAPACITY.value,
                     _DROPLESS.value)
  mode = "dropless" if cfg.moe_dropless else f"capacity factor {cfg.moe_capacity_factor}"
  print(f"MoE layer forward+backward, {cfg.family}, D={cfg.embed_dim} F={cfg.mlp_dim} E={cfg.num_experts} "
        f"top-{cfg.moe_top_k}, {mode}, one sequence, float32, {jax.devices()[0].platform}")
  print("  length  temp MiB  x previous  FLOPs/token / 6N")
  previous = None
  for length in map(int, _LENGTHS.value):
    temp, flops_ratio = measure(cfg, length)
    growth = f"{temp / previous:10.2f}" if previous else " " * 10
    print(f"{length:8d} {temp / 2**20:9.1f}  {growth}  {flops_ratio:16.2f}")
    previous = temp


if __name__ == "__main__":
  app.run(main)
