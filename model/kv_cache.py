"""Decoding with a key/value cache: the model's own blocks, attention reading and writing the cache.

The cache holds every layer's keys and values for max_len positions, stacked
on a leading layers axis like the block parameters. A forward pass over new
tokens runs the ordinary blocks (their norms, projections, rotary positions and
MLPs) with an attention strategy installed that writes the new keys and values
at their positions and attends over the whole cache; slots not yet written hold
later positions than any query, so the causal mask already hides them.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import attention_block
from model.config import ModelConfig
from model.sharding_hooks import constrain, context_strategy
from model.transformer import ACTIVATION_AXES

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")


def init_cache(cfg: ModelConfig, batch: int) -> dict:
  """Empty keys and values for `batch` sequences of up to max_len tokens, per layer."""
  shape_LBSKH = (cfg.num_layers, batch, cfg.max_len, cfg.num_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape_LBSKH, cfg.dtype), "v": jnp.zeros(shape_LBSKH, cfg.dtype)}


def forward_cached(model, tokens_BT, positions_T, cache: dict):
  """Logits for `tokens_BT` at contiguous `positions_T`, attending over the cache; returns (logits, cache)."""
  x_BTD = model.embed_tokens(tokens_BT, positions_T)

  def layer(x_BTD, block, k_BSKH, v_BSKH):
    written = {}

    def cached_attention(q_BTNH, new_k_BTKH, new_v_BTKH, positions_T):
      start = positions_T[0]
      written["k"] = constrain(jax.lax.dynamic_update_slice_in_dim(
          k_BSKH, new_k_BTKH.astype(k_BSKH.dtype), start, axis=1), CACHE_AXES)
      written["v"] = constrain(jax.lax.dynamic_update_slice_in_dim(
          v_BSKH, new_v_BTKH.astype(v_BSKH.dtype), start, axis=1), CACHE_AXES)
      slot_positions_S = jnp.arange(k_BSKH.shape[1])
      out_BTNH, _, _ = attention_block(q_BTNH, written["k"], written["v"], positions_T, slot_positions_S)
      return out_BTNH

    with context_strategy(cached_attention):
      x_BTD = constrain(block(x_BTD, positions_T), ACTIVATION_AXES)
    return x_BTD, (written["k"], written["v"])

  x_BTD, (k_LBSKH, v_LBSKH) = nnx.scan(layer, in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0))(
      x_BTD, model.blocks, cache["k"], cache["v"])
  return model.logits(x_BTD), {"k": k_LBSKH, "v": v_LBSKH}
