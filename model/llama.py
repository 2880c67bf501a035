"""A Llama-style family: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases, untied head."""

from flax import nnx

from model.attention import attention
from model.config import ModelConfig
from model.layers import RMSNorm, head_matmul, matmul, out_projection_std, param, vocab_param
from model.mla import attention_layer
from model.mlp import Mlp
from model.moe import MoE
from model.placement import constrain
from model.rotary import rotary
from model.transformer import ACTIVATION_AXES, LanguageModel, embedding_rows, feed_forward
from model.value_embeds import ValueMix, mixed_values


class Attention(nnx.Module):
  """Grouped-query attention with rotary positions; K key/value heads serve N query heads. Where the family's
  trait or model.qk_norm asks, each query and key head is normalised before rotary by `head_norm_class` (one gain
  per head_dim, shared by the heads: Qwen3's RMSNorm, Gemma 3's (1 + w) form)."""

  head_norm_class = RMSNorm

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_kernel = param(rngs, (d, n, h), ("embed", "heads", "head_dim"))
    self.k_kernel = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"))
    self.v_kernel = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"))
    self.out_kernel = param(rngs, (n, h, d), ("heads", "head_dim", "embed"),
                            std=out_projection_std(cfg))
    if cfg.value_embeds:
      self.value_mix = ValueMix()
    if cfg.head_qk_norm:
      self.q_norm, self.k_norm = (self.head_norm_class(h, cfg.epsilon, axis="head_dim") for _ in range(2))
    self.cfg = cfg

  def project(self, x_BTD):
    """Queries, keys and values before their per-head norms and rotary positions: a family that adds biases or
    other norms extends this."""
    cfg, dtype = self.cfg, self.cfg.dtype
    return (matmul("btd,dnh->btnh", x_BTD, self.q_kernel[...], dtype, cfg.fp8),
            matmul("btd,dkh->btkh", x_BTD, self.k_kernel[...], dtype, cfg.fp8),
            matmul("btd,dkh->btkh", x_BTD, self.v_kernel[...], dtype, cfg.fp8))

  def __call__(self, x_BTD, positions_T, segments_BT=None, cache=None, global_layer=None, value_embed=None):
    cfg = self.cfg
    q_BTNH, k_BTKH, v_BTKH = self.project(x_BTD)
    if cfg.head_qk_norm:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    v_BTKH = mixed_values(self, v_BTKH, value_embed)
    q_BTNH = constrain(rotary(q_BTNH, positions_T, cfg, global_layer), ("batch", "length", "heads", "head_dim"))
    k_BTKH = constrain(rotary(k_BTKH, positions_T, cfg, global_layer), ("batch", "length", "kv_heads", "head_dim"))
    v_BTKH = constrain(v_BTKH, ("batch", "length", "kv_heads", "head_dim"))
    out_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, positions_T, cfg, segments_BT, cache, global_layer)
    return matmul("btnh,nhd->btd", out_BTNH, self.out_kernel[...], cfg.dtype, cfg.fp8)


class Block(nnx.Module):
  """Pre-RMSNorm block; decoding hands it the layer's key/value cache (model/kv_cache.py)."""

  attention_class = Attention  # a family that changes only the attention (model/qwen.py) swaps this

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
    self.norm_attn = RMSNorm(cfg.embed_dim, cfg.epsilon)
    self.attn = attention_layer(cfg, rngs, self.attention_class)
    self.norm_mlp = RMSNorm(cfg.embed_dim, cfg.epsilon)
    self.mlp = MoE(cfg, rngs) if moe else Mlp(cfg, rngs)

  def __call__(self, x_BTD, positions_T, segments_BT=None, cache=None, global_layer=None, value_embed=None):
    attended_BTD = self.attn(self.norm_attn(x_BTD), positions_T, segments_BT, cache, global_layer, value_embed)
    x_BTD = constrain(x_BTD + attended_BTD, ACTIVATION_AXES)
    y_BTD, stats = feed_forward(self.mlp, self.norm_mlp, x_BTD, positions_T)
    return x_BTD + y_BTD, stats


class Llama(LanguageModel):
  """Llama-style decoder (Touvron et al. 2023) in Flax NNX; positions enter only through rotary."""

  block_class = Block

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = vocab_param(rngs, (cfg.padded_vocab, cfg.embed_dim), ("vocab", "embed"), cfg.vocab_size)
    self.stack_blocks(self.block_class, rngs)
    self.norm_final = RMSNorm(cfg.embed_dim, cfg.epsilon)
    self.head = vocab_param(rngs, (cfg.embed_dim, cfg.padded_vocab), ("embed", "vocab"), cfg.vocab_size)

  def embed_tokens(self, tokens_BT, positions_T=None):
    del positions_T  # rotary embeddings apply them inside attention
    return constrain(embedding_rows(self.embed[...], tokens_BT, self.cfg).astype(self.cfg.dtype), ACTIVATION_AXES)

  def final_norm(self, x_BTD):
    return self.norm_final(x_BTD)

  def head_logits(self, x_BTD):
    return constrain(head_matmul("btd,dv->btv", x_BTD, self.head[...], self.cfg), ("batch", "length", "vocab"))
