"""Gemma 2 and Gemma 3's text model (Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size",
2024; "Gemma 3 Technical Report", 2025): Llama's decoder with its own norms, scale and caps.

- RMSNorm multiplies by (1 + w), w starting at zero, in float32.
- Sandwich norms: each sub-layer's output is normalised again before the residual add (post_attention and
  post_feedforward), beside the usual pre-norms.
- The token embedding is multiplied by sqrt(width) (in the compute dtype, as transformers rounds it).
- GeGLU: the gated feed-forward layer with tanh-GELU (the family's traits).
- Options of every family that Gemma 2 sets (model/config.py): attention scores scaled by
  1 / sqrt(model.attention_scale_width) (query_pre_attn_scalar) and soft-capped (model.attention_softcap),
  local layers in a sliding window alternating with global ones (model.global_every: Gemma 2 every other
  layer, Gemma 3 every sixth; model/attention.py per_layer_window), and the logits soft-capped
  (model.logit_softcap).
- Gemma 3 (the family's qk_norm trait) normalises each query and key head by a (1 + w) RMSNorm before
  rotary positions, drops the soft-caps, and rotates its local layers by their own base
  (model.local_rope_theta, 10,000; the global ones by 1,000,000, linearly rescaled in the larger models).
Rotary positions, grouped-query attention and the head are model/llama.py's; a tied checkpoint fills the head
from the token table, as Llama's does.
"""

import jax.numpy as jnp
from flax import nnx

from model import llama
from model.config import ModelConfig
from model.layers import rms_norm, zeros
from model.mla import attention_layer
from model.mlp import Mlp
from model.placement import constrain
from model.transformer import ACTIVATION_AXES, embedding_rows, feed_forward


class RMSNorm(nnx.Module):
  """Root-mean-square normalisation over the last axis (`axis`, its logical name) times (1 + w), w a
  zero-initialised gain, in float32."""

  def __init__(self, dim: int, eps: float, axis: str = "embed"):
    self.scale = zeros((dim,), (axis,))
    self.eps = eps

  def __call__(self, x_BTD):
    return rms_norm(x_BTD, 1.0 + self.scale[...].astype(jnp.float32), self.eps)


class Attention(llama.Attention):
  """llama.Attention, Gemma 3's query and key norms in the (1 + w) form (one gain per head_dim, shared by the heads)."""

  head_norm_class = RMSNorm


class Block(nnx.Module):
  """Pre- and post-normalised attention and feed-forward layers (sandwich norms)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
    del moe  # model/config.py refuses experts with alternating windows, and Gemma has none
    self.norm_attn = RMSNorm(cfg.embed_dim, cfg.epsilon)
    self.attn = attention_layer(cfg, rngs, Attention)
    self.post_norm_attn = RMSNorm(cfg.embed_dim, cfg.epsilon)
    self.norm_mlp = RMSNorm(cfg.embed_dim, cfg.epsilon)
    self.mlp = Mlp(cfg, rngs)
    self.post_norm_mlp = RMSNorm(cfg.embed_dim, cfg.epsilon)

  def __call__(self, x_BTD, positions_T, segments_BT=None, cache=None, global_layer=None, value_embed=None):
    attended_BTD = self.post_norm_attn(self.attn(self.norm_attn(x_BTD), positions_T, segments_BT, cache,
                                                 global_layer, value_embed))
    x_BTD = constrain(x_BTD + attended_BTD, ACTIVATION_AXES)
    y_BTD, stats = feed_forward(self.mlp, self.norm_mlp, x_BTD, positions_T)
    return x_BTD + self.post_norm_mlp(y_BTD), stats


class Gemma(llama.Llama):
  """Gemma 2's and 3's decoder: Llama's, with the blocks, norms and embedding scale above."""

  block_class = Block

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    super().__init__(cfg, rngs)
    self.norm_final = RMSNorm(cfg.embed_dim, cfg.epsilon)

  def embed_tokens(self, tokens_BT, positions_T=None):
    del positions_T  # rotary embeddings apply them inside attention
    rows_BTD = embedding_rows(self.embed[...], tokens_BT, self.cfg).astype(self.cfg.dtype)
    return constrain(rows_BTD * jnp.asarray(self.cfg.embed_dim ** 0.5, self.cfg.dtype), ACTIVATION_AXES)
