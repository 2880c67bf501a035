"""GPT-2 variants. Launch: python train.py --config=configs/gpt2.py:124m --config.mesh.tensor=2

`moe_<variant>` (moe_tiny, moe_124m, ...) swaps each MLP for 8 experts with
top-2 routing: python train.py --config=configs/gpt2.py:moe_tiny --config.mesh.expert=4

`tiny` (the default) trains on the built-in byte corpus on a laptop CPU in a
few minutes; 124m..1558m are the GPT-2 paper's sizes (Radford et al. 2019,
table 2) and want BPE tokens (`tools/prepare.py --tokenizer=gpt2`) and a GPU or TPU.
"""

from configs.base import base

# name: (layers, heads, width)
SIZES = {
    "124m": (12, 12, 768),
    "350m": (24, 16, 1024),
    "774m": (36, 20, 1280),
    "1558m": (48, 25, 1600),
}


def get_config(variant: str = "tiny"):
  if variant.startswith("moe_"):
    return _moe(get_config(variant[len("moe_"):]))
  c = base()
  if variant == "tiny":
    c.model.num_layers, c.model.num_heads, c.model.embed_dim, c.model.mlp_dim = 2, 4, 128, 512
    c.model.max_len, c.model.vocab_size = 128, 256
    c.precision.compute = "float32"  # a CPU emulates bf16 matmuls slowly; tiny is the CPU's model
    c.optimizer.lr = 3e-3
    return c
  if variant not in SIZES:
    raise ValueError(f"unknown GPT-2 variant {variant!r}; choose tiny or one of {', '.join(SIZES)}, "
                     "each also as moe_<size>.")
  layers, heads, width = SIZES[variant]
  c.model.num_layers, c.model.num_heads, c.model.embed_dim = layers, heads, width
  c.model.mlp_dim, c.model.max_len, c.model.vocab_size = 4 * width, 1024, 50257
  c.batch_size, c.steps = 32, 5000
  c.optimizer.lr = 6e-4 if variant == "124m" else 3e-4
  c.schedule.warmup_steps = 200
  c.eval_every = 500
  return c


def _moe(c):
  """The same model with every feed-forward layer a mixture of 8 experts, each token routed to 2."""
  c.moe.experts, c.moe.top_k = 8, 2
  return c
