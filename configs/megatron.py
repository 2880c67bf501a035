"""The GPT models of the Megatron-LM paper's weak-scaling table, for planning against its measured runs.

  python tools/plan.py --config=configs/megatron.py:145.6b --kind=a100 --devices=1536

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (arXiv 2104.04473), Table 1: GPT models (learned
positions, LayerNorm, GeLU MLP of 4x the width, tied head: meshlm's gpt2
family) with a 51,200-token vocabulary and 2,048-token sequences (section 5.1),
trained in mixed precision with activation recomputation on A100s of 80 GB.
ROWS keeps each row's layout and measured throughput; `python tools/planning_tables.py`
puts the planner beside them.
"""

import dataclasses

from configs.base import base


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of Table 1: the model, the paper's layout and what it measured."""
  layers: int
  heads: int
  width: int
  tensor: int
  pipeline: int
  gpus: int
  batch: int
  teraflops_per_gpu: float  # as the paper counts FLOPs (its equation 3: recomputation included)


# Parameters in billions, as the table prints them.
ROWS = {
    "1.7b": Row(24, 24, 2304, 1, 1, 32, 512, 137),
    "3.6b": Row(30, 32, 3072, 2, 1, 64, 512, 138),
    "7.5b": Row(36, 32, 4096, 4, 1, 128, 512, 142),
    "18.4b": Row(40, 48, 6144, 8, 1, 256, 1024, 135),
    "39.1b": Row(48, 64, 8192, 8, 2, 512, 1536, 138),
    "76.1b": Row(60, 80, 10240, 8, 4, 1024, 1792, 140),
    "145.6b": Row(80, 96, 12288, 8, 8, 1536, 2304, 148),
    "310.1b": Row(96, 128, 16384, 8, 16, 1920, 2160, 155),
    "529.6b": Row(105, 128, 20480, 8, 35, 2520, 2520, 163),
    "1008.0b": Row(128, 160, 25600, 8, 64, 3072, 3072, 163),
}
VOCAB, SEQUENCE = 51200, 2048


def paper_flops(row: Row) -> float:
  """FLOPs per iteration as the paper counts them (equation 3): 96 B s l h^2 (1 + s/6h + V/16lh),
  the layers' forward run twice (recomputation) and the logits."""
  b, s, l, h = row.batch, SEQUENCE, row.layers, row.width
  return 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def get_config(variant: str = "1.7b"):
  if variant not in ROWS:
    raise ValueError(f"unknown Megatron-LM row {variant!r}; choose one of {', '.join(ROWS)}.")
  row = ROWS[variant]
  c = base()
  c.model.num_layers, c.model.num_heads, c.model.embed_dim = row.layers, row.heads, row.width
  c.model.mlp_dim, c.model.max_len, c.model.vocab_size = 4 * row.width, SEQUENCE, VOCAB
  c.model.remat = "full"
  c.batch_size = row.batch
  c.mesh.tensor, c.mesh.pipeline, c.mesh.data = row.tensor, row.pipeline, row.gpus // (row.tensor * row.pipeline)
  return c
