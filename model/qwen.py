"""Qwen2/2.5 and Qwen3: Llama's decoder with a different attention projection.

Qwen2 adds biases to the query, key and value projections (not the output's).
Qwen3 drops them and normalises each query and key head by its own RMSNorm
(one gain per head_dim, shared by the heads) before rotary positions, and sets
its head width apart from the model's (model.head_width). Everything else,
MLP, norms, rotary, grouped-query attention and the head, is model/llama.py's.
"""

from flax import nnx

from model import llama
from model.config import ModelConfig
from model.layers import zeros


class Attention(llama.Attention):
  """llama.Attention with the family's query/key/value biases (qwen2); Qwen3's query and key norms are
  llama.Attention's (its qk_norm trait)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    super().__init__(cfg, rngs)
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if cfg.traits.qkv_bias:
      self.q_bias = zeros((n, h), ("heads", "head_dim"))
      self.k_bias = zeros((k, h), ("kv_heads", "head_dim"))
      self.v_bias = zeros((k, h), ("kv_heads", "head_dim"))

  def project(self, x_BTD):
    q_BTNH, k_BTKH, v_BTKH = super().project(x_BTD)
    if self.cfg.traits.qkv_bias:
      q_BTNH, k_BTKH, v_BTKH = (x + bias[...].astype(x.dtype) for x, bias in (
          (q_BTNH, self.q_bias), (k_BTKH, self.k_bias), (v_BTKH, self.v_bias)))
    return q_BTNH, k_BTKH, v_BTKH


class Block(llama.Block):
  attention_class = Attention


class Qwen(llama.Llama):
  """Qwen2 and Qwen3 (Qwen Team, "Qwen2 Technical Report", 2024; "Qwen3 Technical Report", 2025)."""

  block_class = Block
