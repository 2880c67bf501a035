"""Rotary positions (Su et al., "RoFormer", 2021): each (first half, second half) pair of a query or key head
turned by its token's position times the pair's frequency, with the context-extension rescalings transformers
names rope_type (model.rope_*)."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from model.config import ModelConfig


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


def rotary(x_BTNH, positions_T, cfg: ModelConfig, global_layer=None, adjacent: bool = False):
  """Rotate each (first half, second half) pair of x by its token's global position (RoFormer); with
  `adjacent`, each (even, odd) pair instead, as DeepSeek lays out its rotary dimensions (model/mla.py).

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
  pairs = x_BTNH.reshape(*x_BTNH.shape[:-1], half, 2) if adjacent else x_BTNH.reshape(*x_BTNH.shape[:-1], 2, half)
  x1, x2 = (pairs[..., i] if adjacent else pairs[..., i, :] for i in (0, 1))
  x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
  rotated = jnp.stack([x1 * cos_TF - x2 * sin_TF, x2 * cos_TF + x1 * sin_TF], axis=-1 if adjacent else -2)
  return rotated.reshape(x_BTNH.shape).astype(x_BTNH.dtype)
