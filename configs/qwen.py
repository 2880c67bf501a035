"""Qwen2/2.5 and Qwen3 shapes (model/qwen.py). Launch: python train.py --config=configs/qwen.py:qwen3_tiny

Both are configs/llama.py's model with the family's attention: Qwen2 biases
its query, key and value projections, Qwen3 RMS-normalises each query and key
head and sets its head width apart from the model's. `qwen2_tiny` and
`qwen3_tiny` train on the built-in byte corpus on a CPU; the others are the
published shapes (Qwen2.5 and Qwen3 technical reports, and each checkpoint's
config.json), for planning or to hold an imported checkpoint
(`--config.init_from=hf:<directory>` sets the shape from its config.json).
Qwen3-MoE is Qwen3 with every feed-forward layer a mixture of experts (EXPERTS),
each as wide as the mlp width given, none dropped; Qwen2-MoE is Qwen2 with the
same and a shared expert beside them (SHARED_EXPERT) behind a sigmoid gate.
"""

from configs.llama import get_config as llama_config

# name: (family, layers, heads, kv_heads, width, head width (0: width / heads), mlp width, context)
SIZES = {
    "qwen2_tiny": ("qwen2", 2, 4, 2, 128, 0, 384, 128),
    "qwen3_tiny": ("qwen3", 2, 4, 2, 128, 48, 384, 128),
    "qwen2.5_0.5b": ("qwen2", 24, 14, 2, 896, 0, 4864, 32768),
    "qwen2.5_7b": ("qwen2", 28, 28, 4, 3584, 0, 18944, 32768),
    "qwen3_0.6b": ("qwen3", 28, 16, 8, 1024, 128, 3072, 40960),
    "qwen3_8b": ("qwen3", 36, 32, 8, 4096, 128, 12288, 40960),
    "qwen2_moe_tiny": ("qwen2", 2, 4, 2, 128, 0, 192, 128),
    "qwen3_moe_tiny": ("qwen3", 2, 4, 2, 128, 48, 192, 128),
    "qwen3_30b_a3b": ("qwen3", 48, 32, 4, 2048, 128, 768, 40960),
}
EXPERTS = {"qwen2_moe_tiny": (4, 2), "qwen3_moe_tiny": (4, 2), "qwen3_30b_a3b": (128, 8)}  # (experts, per token)
SHARED_EXPERT = {"qwen2_moe_tiny": 384}  # Qwen2-MoE's shared expert's width


def get_config(variant: str = "qwen3_tiny"):
  if variant not in SIZES:
    raise ValueError(f"unknown Qwen variant {variant!r}; choose one of {', '.join(SIZES)}.")
  tiny = variant.endswith("_tiny")
  c = llama_config("tiny" if tiny else "1b")
  family, layers, heads, kv_heads, width, head_width, mlp, context = SIZES[variant]
  c.model.family = family
  c.model.num_layers, c.model.num_heads, c.model.kv_heads = layers, heads, kv_heads
  c.model.embed_dim, c.model.head_width, c.model.mlp_dim, c.model.max_len = width, head_width, mlp, context
  if not tiny:
    c.model.vocab_size, c.model.rope_theta = 151936, 1000000.0
  if variant in EXPERTS:
    (c.moe.experts, c.moe.top_k), c.moe.every, c.moe.dropless = EXPERTS[variant], 1, True
    c.moe.shared_width = SHARED_EXPERT.get(variant, 0)
    c.moe.renormalize = variant.startswith("qwen3")  # Qwen2-MoE keeps the softmax's weights, Qwen3-MoE's sum to one
  return c
