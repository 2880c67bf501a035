"""The terms every cost model is written in: a weight, the per-device sizes a step works on, ring bytes.

Each strategy states its own cost beside its code (parallel/context.py,
parallel/schedules.py, parallel/experts.py, training/optimizer.py,
training/muon.py) in these terms, plain arithmetic on sizes, and measure/
composes them into a step's memory, FLOPs and collective bytes.

Collective bytes are what one device sends under the ring algorithms
(all-reduce 2N(D-1)/D, all-gather and reduce-scatter N(D-1)/D with N the full
buffer, all-to-all N(D-1)/D, collective-permute N), keyed (kind, axes joined
by "+") as measure/analysis.py `traffic_per_step` reads them off compiled HLO.
"""

import dataclasses
import functools
import math

import numpy as np

from parallel import rules
from parallel.mesh import AXES

F32_BYTES = np.dtype(np.float32).itemsize
INT32_BYTES = np.dtype(np.int32).itemsize
MASTER_BYTES = F32_BYTES  # master weights and their gradients are float32 whatever the compute dtype


@dataclasses.dataclass(frozen=True)
class Weight:
  shape: tuple[int, ...]
  axes: tuple  # logical names, None where unnamed
  sides: tuple | None = None  # Muon's (input axes, output axes) where it trains this weight (training/muon.py)
  path: tuple[str, ...] = ()  # its keys in the parameters' tree, which the optimizer's state follows

  @property
  def stacked(self) -> bool:
    return "layers" in self.axes


@dataclasses.dataclass(frozen=True)
class Dims:
  """The per-device sizes a step works on: tokens of one micro-batch, heads and widths per shard."""
  mesh: dict
  batch: int  # sequences per device in one micro-batch (grad_accum and pipeline split the batch)
  length: int  # tokens per sequence on this device (sequence sharding splits it)
  full_length: int
  keys: int  # keys each query scores at once: the whole sequence, or a visiting block's (the ring)
  blockwise: bool  # attention keeps no scores for its backward, only its output and log-sum-exp
  embed: int
  mlp: int  # per tensor shard, likewise heads, kv_heads and vocab
  heads: int
  kv_heads: int
  head_dim: int
  vocab: int
  compute_bytes: int
  context: str  # the context strategy over `sequence` (parallel/context.py), "none" on one shard
  attention_block: int  # model.attention_block: the longest query or key run scored at once
  loss_positions: int  # positions of the local sequence in one chunk of the head and loss (model.loss_chunk)
  mlp_chunks: int  # chunks of positions a dense MLP runs in (model.mlp_chunk; 1: the whole sequence)

  @property
  def tokens(self) -> int:
    return self.batch * self.length

  def activation_bytes(self, width: int) -> int:
    """One [batch, length, width] activation in the compute dtype."""
    return self.tokens * width * self.compute_bytes


def shard_elements(weight: Weight, mesh: dict, table) -> int:
  """Elements of one weight on one device when laid out by a rules table."""
  return _shard_elements(weight.shape, weight.axes, tuple(mesh.items()), table)


def sharded_over(weight: Weight, mesh: dict, table) -> frozenset[str]:
  """The mesh axes above one that split a weight laid out by a rules table."""
  return _sharded_over(weight.axes, tuple(mesh.items()), table)


# Cached: the layout planner asks the same weights on the same meshes thousands of times.
@functools.cache
def _shard_elements(shape: tuple, axes: tuple, mesh_items: tuple, table) -> int:
  mesh, spec = dict(mesh_items), rules.spec(axes, table)
  size = 1
  for dim, entry in zip(shape, tuple(spec) + (None,) * len(shape)):
    size *= -(-dim // math.prod(mesh[a] for a in rules.entry_axes(entry)))
  return size


@functools.cache
def _sharded_over(axes: tuple, mesh_items: tuple, table) -> frozenset[str]:
  mesh = dict(mesh_items)
  return frozenset(a for e in rules.spec(axes, table) for a in rules.entry_axes(e) if mesh[a] > 1)


def axes_key(axes) -> str:
  return "+".join(a for a in AXES if a in axes) or "-"


def all_reduce(n: int, d: int) -> int:
  return 2 * n * (d - 1) // d


def gather(n: int, d: int) -> int:
  """All-gather or reduce-scatter of a buffer whose full size is n; an all-to-all of n."""
  return n * (d - 1) // d
