"""Gemma 2 and Gemma 3 shapes (model/gemma.py). Launch: python train.py --config=configs/gemma.py:gemma3_tiny

configs/llama.py's model with Gemma's family: sandwich norms, GeGLU, the embedding scaled by sqrt(width), scores
scaled by 1 / sqrt(query_pre_attn_scalar), local layers in a sliding window and global ones. Gemma 2 alternates
them (model.global_every=2) and soft-caps scores at 50 and logits at 30; Gemma 3 makes every sixth layer global
(global_every=6, which need not divide the layers: 1B's 26 end with two local ones), normalises queries and keys,
drops the caps and rotates its local layers by a base of 10,000 (model.local_rope_theta), its global ones by
1,000,000 (linearly rescaled x8 from 4B up). The `_tiny` variants train on the built-in byte corpus on a CPU (a
window of 32 in their 128 positions); the others are the published shapes (each checkpoint's config.json), for
planning or to hold an imported checkpoint (`--config.init_from=hf:<directory>` sets the shape from its
config.json).
"""

from configs.llama import get_config as llama_config

# name: (layers, heads, kv_heads, width, head width, mlp width, query_pre_attn_scalar, sliding window, context)
SIZES = {
    "gemma2_tiny": (4, 4, 2, 128, 32, 384, 32, 32, 128),
    "gemma2_2b": (26, 8, 4, 2304, 256, 9216, 256, 4096, 8192),
    "gemma2_9b": (42, 16, 8, 3584, 256, 14336, 256, 4096, 8192),
    "gemma2_27b": (46, 32, 16, 4608, 128, 36864, 144, 4096, 8192),
    "gemma3_tiny": (8, 4, 2, 128, 32, 384, 32, 32, 128),
    "gemma3_1b": (26, 4, 1, 1152, 256, 6912, 256, 512, 32768),
    "gemma3_4b": (34, 8, 4, 2560, 256, 10240, 256, 1024, 131072),
    "gemma3_12b": (48, 16, 8, 3840, 256, 15360, 256, 1024, 131072),
    "gemma3_27b": (62, 32, 16, 5376, 128, 21504, 168, 1024, 131072),
}


def get_config(variant: str = "gemma3_tiny"):
  if variant not in SIZES:
    raise ValueError(f"unknown Gemma variant {variant!r}; choose one of {', '.join(SIZES)}.")
  tiny, gemma3 = variant.endswith("_tiny"), variant.startswith("gemma3")
  c = llama_config("tiny" if tiny else "1b")
  layers, heads, kv_heads, width, head_width, mlp, scale_width, window, context = SIZES[variant]
  c.model.family = "gemma3" if gemma3 else "gemma2"
  c.model.num_layers, c.model.num_heads, c.model.kv_heads = layers, heads, kv_heads
  c.model.embed_dim, c.model.head_width, c.model.mlp_dim, c.model.max_len = width, head_width, mlp, context
  c.model.attention_scale_width, c.model.sliding_window = scale_width, window
  if gemma3:
    c.model.global_every, c.model.local_rope_theta, c.model.rope_theta = 6, 10000.0, 1_000_000.0
    if not tiny and variant != "gemma3_1b":
      c.model.rope_type, c.model.rope_factor = "linear", 8.0
  else:
    c.model.global_every, c.model.attention_softcap, c.model.logit_softcap = 2, 50.0, 30.0
    c.model.rope_theta = 10000.0
  if not tiny:
    c.model.vocab_size = 262144 if gemma3 else 256000
  return c
