"""GPT-2: learned positions, pre-LayerNorm blocks, tanh-GELU MLP, tied embeddings, biases everywhere."""

import jax
from flax import nnx

from model.attention import SelfAttention
from model.config import ModelConfig
from model.layers import INIT_STD, LayerNorm, head_matmul, param, vocab_param
from model.mlp import Mlp
from model.moe import MoE
from model.placement import constrain
from model.transformer import ACTIVATION_AXES, LanguageModel, embedding_rows, feed_forward


class Block(nnx.Module):
  """Pre-LayerNorm transformer block; decoding hands it the layer's key/value cache (model/kv_cache.py)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
    self.ln_attn = LayerNorm(cfg.embed_dim, cfg.epsilon)
    self.attn = SelfAttention(cfg, rngs)
    self.ln_mlp = LayerNorm(cfg.embed_dim, cfg.epsilon)
    self.mlp = MoE(cfg, rngs) if moe else Mlp(cfg, rngs)

  def __call__(self, x_BTD: jax.Array, positions_T: jax.Array, segments_BT=None, cache=None,
               global_layer=None, value_embed=None) -> jax.Array:
    x_BTD = x_BTD + self.attn(self.ln_attn(x_BTD), positions_T, segments_BT, cache, global_layer, value_embed)
    x_BTD = constrain(x_BTD, ACTIVATION_AXES)
    y_BTD, stats = feed_forward(self.mlp, self.ln_mlp, x_BTD, positions_T)
    return x_BTD + y_BTD, stats


class Embed(nnx.Module):
  """Token and learned position embeddings; the token table is tied to the output head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.tokens = vocab_param(rngs, (cfg.padded_vocab, cfg.embed_dim), ("vocab", "embed"), cfg.vocab_size)
    self.positions = param(rngs, (cfg.position_rows, cfg.embed_dim), (None, "embed"), std=INIT_STD / 2)


class GPT2(LanguageModel):
  """GPT-2 (Radford et al. 2019) in Flax NNX."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embed(cfg, rngs)
    self.stack_blocks(Block, rngs)
    self.ln_final = LayerNorm(cfg.embed_dim, cfg.epsilon)

  def embed_tokens(self, tokens_BT, positions_T=None):
    positions_T = jax.numpy.arange(tokens_BT.shape[1]) if positions_T is None else positions_T
    x_BTD = embedding_rows(self.embed.tokens[...], tokens_BT, self.cfg) + self.embed.positions[...][positions_T]
    return constrain(x_BTD.astype(self.cfg.dtype), ACTIVATION_AXES)

  def final_norm(self, x_BTD):
    return self.ln_final(x_BTD)

  def head_logits(self, x_BTD):
    logits_BTV = head_matmul("btd,vd->btv", x_BTD, self.embed.tokens[...], self.cfg)
    return constrain(logits_BTV, ("batch", "length", "vocab"))
