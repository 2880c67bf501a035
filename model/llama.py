"""A Llama-style family: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases, untied head."""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import attention
from model.config import ModelConfig
from model.layers import INIT_STD, matmul, ones, param, rms_norm, vocab_param
from model.mlp import Mlp
from model.moe import MoE
from model.placement import constrain
from model.transformer import ACTIVATION_AXES, LanguageModel, embedding_rows, feed_forward, stacked


class RMSNorm(nnx.Module):
  """Root-mean-square normalisation over the last axis (`axis`, its logical name), in float32."""

  def __init__(self, dim: int, eps: float = 1e-6, axis: str = "embed"):
    self.scale = ones((dim,), (axis,))
    self.eps = eps

  def __call__(self, x_BTD):
    return rms_norm(x_BTD, self.scale[...], self.eps)


def rotary_frequencies(half: int, cfg: ModelConfig, length=None) -> jax.Array:
  """Each rotated pair's angular frequency, theta^(-i / half), rescaled as model.rope_type says.

  `linear` divides every frequency by rope_factor (position interpolation).
  `llama3` (Llama 3.1's, as transformers computes it) divides only the low
  frequencies, whose wavelength is longer than rope_original_max_len /
  rope_low_freq_factor; keeps the high ones, shorter than rope_original_max_len /
  rope_high_freq_factor; and blends the two linearly in 1 / wavelength between.
  `yarn` (YaRN, Peng et al. 2023, as transformers computes it) keeps the pairs
  that turn more than rope_beta_fast times over rope_original_max_len, divides
  those that turn fewer than rope_beta_slow times, and ramps linearly in the
  pair's index between (the ramp's ends rounded outwards with rope_truncate);
  `rope_scale` then scales cos and sin.
  `dynamic` (NTK-aware scaling, as transformers' dynamic type computes it on
  each forward) raises theta with the sequence's `length` once it passes
  rope_original_max_len, to theta (factor length / original - factor + 1)^(half / (half - 1)).
  """
  exponents_F = -jnp.arange(half, dtype=jnp.float32) / half
  if cfg.rope_type == "dynamic":
    growth = cfg.rope_factor * jnp.maximum(length, cfg.rope_original_max_len) / cfg.rope_original_max_len
    return (cfg.rope_theta * (growth - (cfg.rope_factor - 1)) ** (half / (half - 1))) ** exponents_F
  frequencies_F = cfg.rope_theta ** exponents_F
  if cfg.rope_type == "yarn":
    # The pair index at which a frequency turns `rotations` times over the pre-training context.
    index = lambda rotations: half * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / math.log(
        cfg.rope_theta)
    low, high = index(cfg.rope_beta_fast), index(cfg.rope_beta_slow)
    if cfg.rope_truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, 2 * half - 1)
    divided_F = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low if high != low else 0.001), 0, 1)
    return divided_F * frequencies_F / cfg.rope_factor + (1 - divided_F) * frequencies_F
  if cfg.rope_type == "linear":
    return frequencies_F / cfg.rope_factor
  if cfg.rope_type == "llama3":
    wavelengths_F = 2 * math.pi / frequencies_F
    kept_F = jnp.clip((cfg.rope_original_max_len / wavelengths_F - cfg.rope_low_freq_factor)
                      / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor), 0.0, 1.0)
    return (1 - kept_F) * frequencies_F / cfg.rope_factor + kept_F * frequencies_F
  return frequencies_F


def rope_scale(cfg: ModelConfig) -> float:
  """What cos and sin are multiplied by: YaRN's attention factor (rope_attention_factor, else
  0.1 ln(rope_factor) + 1), so that each attention logit grows by its square; 1 for the other types."""
  if cfg.rope_type != "yarn":
    return 1.0
  return cfg.rope_attention_factor or (0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0)


def sequence_length(positions_T) -> jax.Array:
  """The last position + 1 of the whole sequence, also where `positions_T` is one shard of it: inside a map
  manual over the axes it is split over, the shards' largest positions are compared over those axes."""
  length = jnp.max(positions_T) + 1
  split_over = tuple(jax.typeof(positions_T).manual_axis_type.varying)
  return jax.lax.pmax(length, split_over) if split_over else length


def rotary(x_BTNH, positions_T, cfg: ModelConfig, global_layer=None):
  """Rotate each (first half, second half) pair of x by its token's global position (RoFormer).

  With model.local_rope_theta set, a layer that is not global (`global_layer` False; model/transformer.py
  layer_kinds) rotates by that base, without rope_type's rescaling (Gemma 3's local layers)."""
  half = x_BTNH.shape[-1] // 2
  frequencies_F = rotary_frequencies(half, cfg, sequence_length(positions_T) if cfg.rope_type == "dynamic" else None)
  scale = rope_scale(cfg)
  if cfg.local_rope_theta and global_layer is not None:
    local = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_type="default")
    frequencies_F = jnp.where(global_layer, frequencies_F, rotary_frequencies(half, local))
    scale = jnp.where(global_layer, scale, 1.0)
  angles_TF = positions_T.astype(jnp.float32)[:, None] * frequencies_F[None, :]
  cos_TF, sin_TF = scale * jnp.cos(angles_TF)[:, None, :], scale * jnp.sin(angles_TF)[:, None, :]
  x1, x2 = x_BTNH[..., :half].astype(jnp.float32), x_BTNH[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([x1 * cos_TF - x2 * sin_TF, x2 * cos_TF + x1 * sin_TF], axis=-1)
  return rotated.astype(x_BTNH.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with rotary positions; K key/value heads serve N query heads."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_kernel = param(rngs, (d, n, h), ("embed", "heads", "head_dim"))
    self.k_kernel = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"))
    self.v_kernel = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"))
    self.out_kernel = param(rngs, (n, h, d), ("heads", "head_dim", "embed"),
                            std=INIT_STD / (2 * cfg.num_layers) ** 0.5)
    self.cfg = cfg

  def project(self, x_BTD):
    """Queries, keys and values before rotary positions: a family that adds biases or norms extends this."""
    cfg, dtype = self.cfg, self.cfg.dtype
    return (matmul("btd,dnh->btnh", x_BTD, self.q_kernel[...], dtype, cfg.fp8),
            matmul("btd,dkh->btkh", x_BTD, self.k_kernel[...], dtype, cfg.fp8),
            matmul("btd,dkh->btkh", x_BTD, self.v_kernel[...], dtype, cfg.fp8))

  def __call__(self, x_BTD, positions_T, segments_BT=None, cache=None, global_layer=None):
    cfg = self.cfg
    q_BTNH, k_BTKH, v_BTKH = self.project(x_BTD)
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
    self.attn = self.attention_class(cfg, rngs)
    self.norm_mlp = RMSNorm(cfg.embed_dim, cfg.epsilon)
    self.mlp = MoE(cfg, rngs) if moe else Mlp(cfg, rngs)

  def __call__(self, x_BTD, positions_T, segments_BT=None, cache=None, global_layer=None):
    attended_BTD = self.attn(self.norm_attn(x_BTD), positions_T, segments_BT, cache, global_layer)
    x_BTD = constrain(x_BTD + attended_BTD, ACTIVATION_AXES)
    y_BTD, stats = feed_forward(self.mlp, self.norm_mlp, x_BTD, positions_T)
    return x_BTD + y_BTD, stats


class Llama(LanguageModel):
  """Llama-style decoder (Touvron et al. 2023) in Flax NNX; positions enter only through rotary."""

  block_class = Block

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = vocab_param(rngs, (cfg.padded_vocab, cfg.embed_dim), ("vocab", "embed"), cfg.vocab_size)
    self.blocks = stacked(self.block_class, cfg, rngs)
    self.norm_final = RMSNorm(cfg.embed_dim, cfg.epsilon)
    self.head = vocab_param(rngs, (cfg.embed_dim, cfg.padded_vocab), ("embed", "vocab"), cfg.vocab_size)

  def embed_tokens(self, tokens_BT, positions_T=None):
    del positions_T  # rotary embeddings apply them inside attention
    return constrain(embedding_rows(self.embed[...], tokens_BT, self.cfg).astype(self.cfg.dtype), ACTIVATION_AXES)

  def head_output(self, x_BTD):
    x_BTD = self.norm_final(x_BTD)
    return constrain(matmul("btd,dv->btv", x_BTD, self.head[...], self.cfg.dtype), ("batch", "length", "vocab"))
