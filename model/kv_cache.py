"""Decoding with a key/value cache: the model's own blocks, attention reading and writing the cache.

The cache holds every layer's keys and values for max_len positions, stacked
on leading (unit, layer in unit) axes like the block parameters (a MoE model
scans units of moe_every layers; a dense one, units of one). A forward pass over new
tokens runs the ordinary blocks (their norms, projections, rotary positions and
MLPs) one layer at a time, each with an attention strategy installed that
holds that layer's cache: it writes the new keys and values at their
positions and attends over the whole cache; slots not yet written hold later
positions than any query, so the causal mask already hides them.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import blockwise_attention
from model.config import ModelConfig
from model.sharding_hooks import constrain, context_strategy
from model.transformer import ACTIVATION_AXES, MoeUnit

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")


def init_cache(cfg: ModelConfig, batch: int) -> dict:
  """Empty keys and values for `batch` sequences of up to max_len tokens, per layer."""
  shape_UlBSKH = (cfg.num_units, cfg.layers_per_unit, batch, cfg.max_len, cfg.num_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape_UlBSKH, cfg.dtype), "v": jnp.zeros(shape_UlBSKH, cfg.dtype)}


def forward_cached(model, tokens_BT, positions_T, cache: dict):
  """Logits for `tokens_BT` at contiguous `positions_T`, attending over the cache; returns (logits, cache)."""
  x_BTD = model.embed_tokens(tokens_BT, positions_T)

  def unit(x_BTD, block, k_lBSKH, v_lBSKH):
    written = []
    for layer, (k_BSKH, v_BSKH) in zip(block.layers if isinstance(block, MoeUnit) else [block],
                                       zip(k_lBSKH, v_lBSKH), strict=True):
      with context_strategy(_cached_attention(k_BSKH, v_BSKH, written)):
        x_BTD, _ = layer(x_BTD, positions_T)  # a MoE layer's router statistics are not needed here
    k_lBSKH, v_lBSKH = (jnp.stack(cached) for cached in zip(*written, strict=True))
    return constrain(x_BTD, ACTIVATION_AXES), (k_lBSKH, v_lBSKH)

  x_BTD, (k_UlBSKH, v_UlBSKH) = nnx.scan(unit, in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0))(
      x_BTD, model.blocks, cache["k"], cache["v"])
  return model.logits(x_BTD), {"k": k_UlBSKH, "v": v_UlBSKH}


def _cached_attention(k_BSKH, v_BSKH, written: list):
  """The attention strategy of one layer whose cache is (k_BSKH, v_BSKH): appends the updated cache to `written`."""

  def attend(q_BTNH, new_k_BTKH, new_v_BTKH, positions_T, block):
    write = lambda cache, new: constrain(jax.lax.dynamic_update_slice_in_dim(
        cache, new.astype(cache.dtype), positions_T[0], axis=1), CACHE_AXES)
    k_new_BSKH, v_new_BSKH = write(k_BSKH, new_k_BTKH), write(v_BSKH, new_v_BTKH)
    written.append((k_new_BSKH, v_new_BSKH))
    out_BTNH, _ = blockwise_attention(q_BTNH, k_new_BSKH, v_new_BSKH, positions_T,
                                      jnp.arange(k_new_BSKH.shape[1]), block)
    return out_BTNH

  return attend
