"""Decoding with a key/value cache: the model's own blocks, each handed its layer's cache.

The cache holds every layer's keys and values for max_len positions, stacked
on leading (unit, layer in unit) axes like the block parameters (a MoE model
scans units of moe_every layers; a dense one, units of one). A forward pass over new
tokens runs the ordinary blocks (their norms, projections, rotary positions and
MLPs) one layer at a time, each called with a LayerCache that its attention
writes the new keys and values into at their positions before attending over
the whole cache; slots not yet written hold later positions than any query, so
the causal mask already hides them.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import blockwise_attention
from model.config import ModelConfig
from model.placement import constrain
from model.transformer import ACTIVATION_AXES, MoeUnit

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")


def init_cache(cfg: ModelConfig, batch: int) -> dict:
  """Empty keys and values for `batch` sequences of up to max_len tokens, per layer."""
  shape_UlBSKH = (cfg.num_units, cfg.layers_per_unit, batch, cfg.max_len, cfg.num_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape_UlBSKH, cfg.dtype), "v": jnp.zeros(shape_UlBSKH, cfg.dtype)}


class LayerCache:
  """One layer's cached keys and values, (batch, max_len, kv_heads, head_dim) each.

  Mutable, as NNX's own cache variables are: attention writes the new tokens
  in while the block returns only its output, and the caller reads the cache
  back afterwards.
  """

  def __init__(self, k_BSKH, v_BSKH):
    self.k_BSKH, self.v_BSKH = k_BSKH, v_BSKH

  def attend(self, q_BTNH, new_k_BTKH, new_v_BTKH, positions_T, block: int, window: int = 0):
    """Write the new keys and values at their contiguous `positions_T`, then attend over the whole cache (within
    a sliding `window`, if W > 0: the cache still holds every position, the mask keeps the last W)."""
    write = lambda cache, new: constrain(jax.lax.dynamic_update_slice_in_dim(
        cache, new.astype(cache.dtype), positions_T[0], axis=1), CACHE_AXES)
    self.k_BSKH, self.v_BSKH = write(self.k_BSKH, new_k_BTKH), write(self.v_BSKH, new_v_BTKH)
    out_BTNH, _ = blockwise_attention(q_BTNH, self.k_BSKH, self.v_BSKH, positions_T,
                                      jnp.arange(self.k_BSKH.shape[1]), block, window=window)
    return out_BTNH


def forward_cached(model, tokens_BT, positions_T, cache: dict):
  """Logits for `tokens_BT` at contiguous `positions_T`, attending over the cache; returns (logits, cache)."""
  x_BTD = model.embed_tokens(tokens_BT, positions_T)

  def unit(x_BTD, block, k_lBSKH, v_lBSKH):
    caches = [LayerCache(k_BSKH, v_BSKH) for k_BSKH, v_BSKH in zip(k_lBSKH, v_lBSKH)]
    for layer, layer_cache in zip(block.layers if isinstance(block, MoeUnit) else [block], caches, strict=True):
      x_BTD, _ = layer(x_BTD, positions_T, cache=layer_cache)  # a MoE layer's router statistics are not needed
    k_lBSKH, v_lBSKH = jnp.stack([c.k_BSKH for c in caches]), jnp.stack([c.v_BSKH for c in caches])
    return constrain(x_BTD, ACTIVATION_AXES), (k_lBSKH, v_lBSKH)

  x_BTD, (k_UlBSKH, v_UlBSKH) = nnx.scan(unit, in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0))(
      x_BTD, model.blocks, cache["k"], cache["v"])
  return model.logits(x_BTD), {"k": k_UlBSKH, "v": v_UlBSKH}
