"""The frozen model description: everything the model needs, nothing about the run."""

import dataclasses

import jax.numpy as jnp

VOCAB_MULTIPLE = 128  # pad the vocabulary so the embedding shards evenly and matmuls tile well
NORM_EPS = {"gpt2": 1e-5, "llama": 1e-6}  # each family's published normalisation epsilon


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str  # gpt2 | llama
  num_layers: int
  num_heads: int
  embed_dim: int
  mlp_dim: int
  max_len: int
  vocab_size: int
  remat: str = "none"  # none | full | save_dots
  attention: str = "xla"  # xla | cudnn
  compute_dtype: str = "float32"
  kv_heads: int = 0  # llama's grouped-query attention; 0 means as many as num_heads
  rope_theta: float = 10000.0
  norm_eps: float = 0.0  # LayerNorm / RMSNorm epsilon; 0 means the family's own (NORM_EPS)

  @property
  def head_dim(self) -> int:
    return self.embed_dim // self.num_heads

  @property
  def num_kv_heads(self) -> int:
    return self.kv_heads or self.num_heads

  @property
  def epsilon(self) -> float:
    return self.norm_eps or NORM_EPS[self.family]

  @property
  def padded_vocab(self) -> int:
    return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

  @property
  def dtype(self):
    return jnp.dtype(self.compute_dtype)

  def __post_init__(self):
    if self.embed_dim % self.num_heads:
      raise ValueError(
          f"model.embed_dim={self.embed_dim} is not divisible by model.num_heads={self.num_heads}; "
          "choose heads that divide the width.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} is not a multiple of model.kv_heads={self.num_kv_heads}; "
          "grouped-query attention shares each key/value head among an equal number of query heads.")
    if self.remat not in ("none", "full", "save_dots"):
      raise ValueError(f"model.remat={self.remat!r} is unknown; use none, full or save_dots.")
    if self.attention not in ("xla", "cudnn"):
      raise ValueError(f"model.attention={self.attention!r} is unknown; use xla or cudnn.")
    if self.compute_dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(
          f"precision.compute={self.compute_dtype!r} is unknown; use float32, bfloat16 or float16.")
