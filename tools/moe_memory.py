"""Compiled temporaries and FLOPs of one MoE layer's forward and backward against sequence length.

  python tools/moe_memory.py --lengths 256,512,1024,2048,4096
  python tools/moe_memory.py --dropless

Compiles ahead of time on one device, allocating nothing: one sequence (one
routing group) through a GPT-2-small-sized MoE layer (8 experts, top 2, or
--family=llama for SwiGLU experts), gradients of its inputs and weights. Prints
XLA's temporary bytes, and its FLOP count per token against 6 N, N the
active parameters a token uses: k experts' matmuls and the router.
"""

import jax
from absl import app, flags

from measure.moe_memory import layer_config, measure
from model.families import FAMILIES

_LENGTHS = flags.DEFINE_list("lengths", ["256", "512", "1024", "2048", "4096"], "Sequence lengths.")
_FAMILY = flags.DEFINE_enum("family", "gpt2", list(FAMILIES), "GELU experts (gpt2) or SwiGLU (llama).")
_EMBED = flags.DEFINE_integer("embed", 768, "Model width D.")
_MLP = flags.DEFINE_integer("mlp", 3072, "Expert hidden width F.")
_EXPERTS = flags.DEFINE_integer("experts", 8, "Experts E.")
_TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token k.")
_CAPACITY = flags.DEFINE_float("capacity_factor", 1.0, "Slots per expert in units of the fair share k T / E.")
_DROPLESS = flags.DEFINE_bool("dropless", False, "Every choice kept: the grouped matmuls (ragged_dot).")


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
