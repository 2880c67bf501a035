"""OLMoE shapes (model/olmoe.py). Launch: python train.py --config=configs/olmoe.py:olmoe_tiny

Llama's model with queries and keys RMS-normalised over their whole width and
every feed-forward layer a mixture of experts, top-k of the softmax kept as it
is (no renormalisation), none dropped. `olmoe_tiny` trains on the built-in byte
corpus on a CPU; `olmoe_1b_7b` is OLMoE-1B-7B's published shape (its
config.json), for planning or to hold an imported checkpoint
(`--config.init_from=hf:<directory>` sets the shape from its config.json).
"""

from configs.llama import get_config as llama_config

# name: (layers, heads, kv_heads, width, expert width, experts, experts per token, context)
SIZES = {
    "olmoe_tiny": (2, 4, 4, 128, 128, 4, 2, 128),
    "olmoe_1b_7b": (16, 16, 16, 2048, 1024, 64, 8, 4096),
}


def get_config(variant: str = "olmoe_tiny"):
  if variant not in SIZES:
    raise ValueError(f"unknown OLMoE variant {variant!r}; choose one of {', '.join(SIZES)}.")
  tiny = variant.endswith("_tiny")
  c = llama_config("tiny" if tiny else "1b")
  layers, heads, kv_heads, width, mlp, experts, top_k, context = SIZES[variant]
  c.model.family = "olmoe"
  c.model.num_layers, c.model.num_heads, c.model.kv_heads = layers, heads, kv_heads
  c.model.embed_dim, c.model.mlp_dim, c.model.max_len = width, mlp, context
  c.moe.experts, c.moe.top_k, c.moe.every, c.moe.dropless, c.moe.renormalize = experts, top_k, 1, True, False
  if not tiny:
    c.model.vocab_size, c.model.rope_theta, c.model.norm_eps = 50304, 10000.0, 1e-5
  return c
