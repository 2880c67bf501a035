"""Llama-style variants. Launch: python train.py --config=configs/llama.py:tiny --config.mesh.sequence=4 --config.attention.context=ring

RMSNorm, rotary positions, SwiGLU, grouped-query attention (kv_heads < heads),
no biases, untied embeddings. `tiny` trains on the built-in byte corpus on a
CPU; `long` is tiny with a 4,096-token context, for sequence parallelism;
`1b` is a Llama-3.2-1B-shaped model for accelerators. `moe_<variant>` makes
every other layer's SwiGLU a mixture of 8 experts with top-2 routing.
"""

from configs.base import base

# name: (layers, heads, kv_heads, width, mlp width, context)
SIZES = {
    "tiny": (2, 4, 2, 128, 384, 128),
    "long": (2, 4, 2, 128, 384, 4096),
    "1b": (16, 32, 8, 2048, 8192, 2048),
}


def get_config(variant: str = "tiny"):
  if variant.startswith("moe_"):
    c = get_config(variant[len("moe_"):])
    # Mixtral's shape: 8 SwiGLU experts, 2 per token; here every other layer, as in Switch Transformer.
    c.moe.experts, c.moe.top_k, c.moe.every = 8, 2, 2
    return c
  if variant not in SIZES:
    raise ValueError(f"unknown Llama variant {variant!r}; choose one of {', '.join(SIZES)}, "
                     "each also as moe_<size>.")
  c = base()
  layers, heads, kv_heads, width, mlp, context = SIZES[variant]
  c.model.family = "llama"
  c.model.num_layers, c.model.num_heads, c.model.kv_heads = layers, heads, kv_heads
  c.model.embed_dim, c.model.mlp_dim, c.model.max_len = width, mlp, context
  c.model.rope_theta = 500000.0 if variant == "1b" else 10000.0
  if variant == "1b":
    c.model.vocab_size = 128256
    c.batch_size, c.steps, c.optimizer.lr = 32, 5000, 3e-4
    return c
  c.model.vocab_size = 256
  c.precision.compute = "float32"  # the CPU variants: a CPU emulates bf16 matmuls slowly
  c.optimizer.lr = 3e-3
  if variant == "long":
    c.batch_size = 8
  return c
