"""Gemma 2 shapes (model/gemma.py). Launch: python train.py --config=configs/gemma.py:gemma2_tiny

configs/llama.py's model with Gemma 2's family: sandwich norms, GeGLU, the embedding scaled by sqrt(width),
local layers in a sliding window alternating with global ones (model.global_every=2), scores scaled by
1 / sqrt(query_pre_attn_scalar) and soft-capped at 50, logits soft-capped at 30. `gemma2_tiny` trains on the
built-in byte corpus on a CPU (a window of 32 in its 128 positions); the others are the published shapes
(each checkpoint's config.json), for planning or to hold an imported checkpoint
(`--config.init_from=hf:<directory>` sets the shape from its config.json).
"""

from configs.llama import get_config as llama_config

# name: (layers, heads, kv_heads, width, head width, mlp width, query_pre_attn_scalar, sliding window, context)
SIZES = {
    "gemma2_tiny": (4, 4, 2, 128, 32, 384, 32, 32, 128),
    "gemma2_2b": (26, 8, 4, 2304, 256, 9216, 256, 4096, 8192),
    "gemma2_9b": (42, 16, 8, 3584, 256, 14336, 256, 4096, 8192),
    "gemma2_27b": (46, 32, 16, 4608, 128, 36864, 144, 4096, 8192),
}


def get_config(variant: str = "gemma2_tiny"):
  if variant not in SIZES:
    raise ValueError(f"unknown Gemma variant {variant!r}; choose one of {', '.join(SIZES)}.")
  tiny = variant.endswith("_tiny")
  c = llama_config("tiny" if tiny else "1b")
  layers, heads, kv_heads, width, head_width, mlp, scale_width, window, context = SIZES[variant]
  c.model.family = "gemma2"
  c.model.num_layers, c.model.num_heads, c.model.kv_heads = layers, heads, kv_heads
  c.model.embed_dim, c.model.head_width, c.model.mlp_dim, c.model.max_len = width, head_width, mlp, context
  c.model.attention_scale_width, c.model.sliding_window, c.model.global_every = scale_width, window, 2
  c.model.attention_softcap, c.model.logit_softcap = 50.0, 30.0
  if not tiny:
    c.model.vocab_size, c.model.rope_theta = 256000, 10000.0
  return c
