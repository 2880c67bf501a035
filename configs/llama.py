"""Llama-style variants. Launch: python train.py --config=configs/llama.py:tiny --config.mesh.sequence=4 --config.attention.context=ring

RMSNorm, rotary positions, SwiGLU, grouped-query attention (kv_heads < heads),
no biases, untied embeddings. `tiny` trains on the built-in byte corpus on a
CPU; `long` is tiny with a 4,096-token context, for sequence parallelism;
`1b` is a Llama-3.2-1B-shaped model for accelerators; `8b`, `70b` and `405b` are
Llama 3.1's shapes (Llama Team, "The Llama 3 Herd of Models", 2024, table 3), for
planning (tools/plan.py) and dry runs. `moe_<variant>` makes
every other layer's SwiGLU a mixture of 8 experts with top-2 routing.
`mixtral_8x7b` is Mixtral 8x7B's shape (its config.json): Llama 3 8B's blocks
with every feed-forward layer 8 experts, 2 per token, none dropped, as
`--config.init_from=hf:<directory>` sets up a Mixtral checkpoint.
"""

from configs.base import base

# name: (layers, heads, kv_heads, width, mlp width, context)
SIZES = {
    "tiny": (2, 4, 2, 128, 384, 128),
    "long": (2, 4, 2, 128, 384, 4096),
    "1b": (16, 32, 8, 2048, 8192, 2048),
    "8b": (32, 32, 8, 4096, 14336, 8192),
    "70b": (80, 64, 8, 8192, 28672, 8192),
    "405b": (126, 128, 8, 16384, 53248, 8192),
}
CPU_VARIANTS = ("tiny", "long")


def get_config(variant: str = "tiny"):
  if variant == "mixtral_8x7b":
    c = get_config("8b")  # 32 layers, 32 heads, 8 kv heads, width 4096, experts 14336 wide
    c.model.vocab_size, c.model.max_len, c.model.rope_theta = 32000, 32768, 1000000.0
    c.moe.experts, c.moe.top_k, c.moe.every, c.moe.dropless = 8, 2, 1, True
    return c
  if variant.startswith("moe_"):
    c = get_config(variant[len("moe_"):])
    # Mixtral's shape: 8 SwiGLU experts, 2 per token; here every other layer, as in Switch Transformer.
    c.moe.experts, c.moe.top_k, c.moe.every = 8, 2, 2
    return c
  if variant not in SIZES:
    raise ValueError(f"unknown Llama variant {variant!r}; choose one of {', '.join(SIZES)}, "
                     "each also as moe_<size>, or mixtral_8x7b.")
  c = base()
  layers, heads, kv_heads, width, mlp, context = SIZES[variant]
  c.model.family = "llama"
  c.model.num_layers, c.model.num_heads, c.model.kv_heads = layers, heads, kv_heads
  c.model.embed_dim, c.model.mlp_dim, c.model.max_len = width, mlp, context
  c.model.rope_theta = 10000.0 if variant in CPU_VARIANTS else 500000.0
  if variant not in CPU_VARIANTS:
    c.model.vocab_size = 128256
    c.batch_size, c.steps, c.optimizer.lr = 32, 5000, 3e-4
    return c
  c.model.vocab_size = 256
  c.precision.compute = "float32"  # the CPU variants: a CPU emulates bf16 matmuls slowly
  c.optimizer.lr = 3e-3
  if variant == "long":
    c.batch_size = 8
  return c
