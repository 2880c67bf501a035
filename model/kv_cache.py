"""Decoding with a key/value cache: the model's own blocks, attention reading and writing the cache.

The cache holds every layer's keys and values for max_len positions, stacked
on leading (unit, layer in unit) axes like the block parameters (a MoE model
scans units of moe_every layers; a dense one, units of one). A forward pass over new
tokens runs the ordinary blocks (their norms, projections, rotary positions and
MLPs) with an attention strategy installed that writes the new keys and values
at their positions and attends over the whole cache; slots not yet written hold
later positions than any query, so the causal mask already hides them.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import blockwise_attention
from model.config import ModelConfig
from model.sharding_hooks import constrain, context_strategy
from model.transformer import ACTIVATION_AXES

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")


def init_cache(cfg: ModelConfig, batch: int) -> dict:
  """Empty keys and values for `batch` sequences of up to max_len tokens, per layer."""
  shape_UlBSKH = (cfg.num_units, cfg.layers_per_unit, batch, cfg.max_len, cfg.num_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape_UlBSKH, cfg.dtype), "v": jnp.zeros(shape_UlBSKH, cfg.dtype)}


def forward_cached(model, tokens_BT, positions_T, cache: dict):
  """Logits for `tokens_BT` at contiguous `positions_T`, attending over the cache; returns (logits, cache)."""
  x_BTD = model.embed_tokens(tokens_BT, positions_T)

  def unit(x_BTD, block, k_lBSKH, v_lBSKH):
    written = {"k": [], "v": []}

    def cached_attention(q_BTNH, new_k_BTKH, new_v_BTKH, positions_T, block):
      layer, start = len(written["k"]), positions_T[0]  # the unit's layers attend in order
      k_BSKH = constrain(jax.lax.dynamic_update_slice_in_dim(
          k_lBSKH[layer], new_k_BTKH.astype(k_lBSKH.dtype), start, axis=1), CACHE_AXES)
      v_BSKH = constrain(jax.lax.dynamic_update_slice_in_dim(
          v_lBSKH[layer], new_v_BTKH.astype(v_lBSKH.dtype), start, axis=1), CACHE_AXES)
      written["k"].append(k_BSKH)
      written["v"].append(v_BSKH)
      slot_positions_S = jnp.arange(k_BSKH.shape[1])
      out_BTNH, _ = blockwise_attention(q_BTNH, k_BSKH, v_BSKH, positions_T, slot_positions_S, block)
      return out_BTNH

    with context_strategy(cached_attention):
      x_BTD, _ = block(x_BTD, positions_T)  # a MoE unit's router statistics are not needed here
    return constrain(x_BTD, ACTIVATION_AXES), (jnp.stack(written["k"]), jnp.stack(written["v"]))

  x_BTD, (k_UlBSKH, v_UlBSKH) = nnx.scan(unit, in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0))(
      x_BTD, model.blocks, cache["k"], cache["v"])
  return model.logits(x_BTD), {"k": k_UlBSKH, "v": v_UlBSKH}
