"""Decoding with a key/value cache: the model's own blocks, each handed its layer's cache.

The cache holds every layer's keys and values for max_len positions, stacked
on leading (unit, layer in unit) axes like the block parameters (a MoE model
scans units of moe_every layers; a dense one, units of one). A forward pass over new
tokens runs the ordinary blocks (their norms, projections, rotary positions and
MLPs) one layer at a time, each called with a LayerCache that its attention
writes the new keys and values into at their positions before attending over
the whole cache; slots not yet written hold later positions than any query, so
the causal mask already hides them.

With a sliding window of W positions (model.sliding_window) no query looks
further back than W - 1 positions, so the cache is a rolling buffer of W slots
rather than max_len: position p lives in slot p mod W, the new tokens attend
over the buffer as it was (each slot at the latest position it holds) and over
themselves, and then their last W overwrite the slots of the positions W before.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model import unet, value_embeds
from model.attention import blockwise_attention, per_layer_window
from model.config import ModelConfig
from model.placement import constrain
from model.stack import ACTIVATION_AXES, DENSE_STACKED, Unit, layer_kinds

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")


def cache_length(cfg: ModelConfig) -> int:
  """Slots per layer: max_len, or a rolling buffer of the sliding window's W positions where it is shorter."""
  if cfg.global_every:  # the global layers see every position; the local ones mask theirs by window
    return cfg.max_len
  return min(cfg.max_len, cfg.sliding_window) if cfg.sliding_window else cfg.max_len


def init_cache(cfg: ModelConfig, batch: int) -> dict:
  """Empty keys and values for `batch` sequences of up to max_len tokens, per layer; under multi-head latent
  attention (model/mla.py) each token's latent in "k" and its rotary key in "v", one shared "head" each. The
  dense layers before the routed ones (moe.first_dense) keep theirs under "dense_k" and "dense_v"."""
  k_shape, v_shape = (((1, cfg.mla_kv_rank), (1, cfg.mla_rope_dim)) if cfg.mla_kv_rank else
                      ((cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)))
  stacks = {"": (cfg.num_units, cfg.layers_per_unit), "dense_": (cfg.moe_first_dense, 1)}
  return {f"{prefix}{name}": jnp.zeros((*units, batch, cache_length(cfg), *shape), cfg.dtype)
          for prefix, units in stacks.items() if units[0] for name, shape in (("k", k_shape), ("v", v_shape))}


class LayerCache:
  """One layer's cached keys and values, (batch, max_len, kv_heads, head_dim) each.

  Mutable, as NNX's own cache variables are: attention writes the new tokens
  in while the block returns only its output, and the caller reads the cache
  back afterwards.
  """

  def __init__(self, k_BSKH, v_BSKH):
    self.k_BSKH, self.v_BSKH = k_BSKH, v_BSKH

  def attend(self, q_BTNH, new_k_BTKH, new_v_BTKH, positions_T, block: int, window: int = 0, softcap: float = 0.0,
             global_layer=None):
    """Write the new keys and values at their contiguous `positions_T`, then attend over the whole cache (within
    a sliding `window` W > 0, over the rolling buffer and the new tokens; scores soft-capped at `softcap`; with
    `global_layer`, the window as model/attention.py per_layer_window applies it, over the whole cache)."""
    slots = self.k_BSKH.shape[1]
    if window and slots == window and global_layer is None:
      return self._attend_rolling(q_BTNH, new_k_BTKH, new_v_BTKH, positions_T, block, window, softcap)
    self.write(positions_T, new_k_BTKH, new_v_BTKH)
    attend = lambda window: blockwise_attention(q_BTNH, self.k_BSKH, self.v_BSKH, positions_T, jnp.arange(slots),
                                                block, window=window, softcap=softcap)[0]
    return per_layer_window(attend, window, global_layer)

  def write(self, positions_T, new_k_BTKH, new_v_BTKH, axes=CACHE_AXES):
    """Write new keys and values (or what stands for them: model/mla.py's latents) at contiguous `positions_T`."""
    write = lambda cache, new: constrain(jax.lax.dynamic_update_slice_in_dim(
        cache, new.astype(cache.dtype), positions_T[0], axis=1), axes)
    self.k_BSKH, self.v_BSKH = write(self.k_BSKH, new_k_BTKH), write(self.v_BSKH, new_v_BTKH)

  def _attend_rolling(self, q_BTNH, new_k_BTKH, new_v_BTKH, positions_T, block: int, window: int, softcap: float):
    start = positions_T[0]
    # Slot s holds the latest position before `start` that is s mod W; one never written (negative) is moved
    # past every query, where the causal mask hides it.
    slot_S = jnp.arange(window)
    held_S = start - 1 - jnp.mod(start - 1 - slot_S, window)
    held_S = jnp.where(held_S < 0, jnp.iinfo(jnp.int32).max, held_S)
    both = lambda cache, new: jnp.concatenate([cache, new.astype(cache.dtype)], axis=1)
    out_BTNH, _ = blockwise_attention(q_BTNH, both(self.k_BSKH, new_k_BTKH), both(self.v_BSKH, new_v_BTKH),
                                      positions_T, jnp.concatenate([held_S, positions_T]), block, window=window,
                                      softcap=softcap)
    last = min(window, positions_T.shape[0])  # the new tokens a later query can still see
    write = lambda cache, new: constrain(cache.at[:, jnp.mod(positions_T[-last:], window)].set(
        new[:, -last:].astype(cache.dtype)), CACHE_AXES)
    self.k_BSKH, self.v_BSKH = write(self.k_BSKH, new_k_BTKH), write(self.v_BSKH, new_v_BTKH)
    return out_BTNH


def forward_cached(model, tokens_BT, positions_T, cache: dict):
  """Logits for `tokens_BT` at contiguous `positions_T`, attending over the cache; returns (logits, cache).

  The new tokens' value rows (model.value_embeds) and the U-net's skips (model.unet_skips) enter as in training.
  """
  x_BTD = model.embed_tokens(tokens_BT, positions_T)
  value_rows = model.value_rows(tokens_BT)

  def unit(x_BTD, block, k_lBSKH, v_lBSKH, kinds, skip, keep_outputs=False):
    x_BTD = unet.with_skip(x_BTD, skip)
    caches = [LayerCache(k_BSKH, v_BSKH) for k_BSKH, v_BSKH in zip(k_lBSKH, v_lBSKH)]
    for layer, layer_cache in zip(block.layers if isinstance(block, Unit) else [block], caches, strict=True):
      # a MoE layer's router statistics are not needed
      x_BTD, _ = layer(x_BTD, positions_T, cache=layer_cache, **value_embeds.block_kinds(kinds, value_rows))
    k_lBSKH, v_lBSKH = jnp.stack([c.k_BSKH for c in caches]), jnp.stack([c.v_BSKH for c in caches])
    x_BTD = constrain(x_BTD, ACTIVATION_AXES)
    return x_BTD, ((k_lBSKH, v_lBSKH, x_BTD) if keep_outputs else (k_lBSKH, v_lBSKH))

  def run(x_BTD, blocks, k, v, kinds, skips=None, keep_outputs=False):
    scanned = nnx.scan(lambda *args: unit(*args, keep_outputs), in_axes=(nnx.Carry, 0, 0, 0, 0, 0),
                       out_axes=(nnx.Carry, 0))
    x_BTD, ys = scanned(x_BTD, blocks, k, v, kinds, skips)
    return (x_BTD, ys[:2], ys[2]) if keep_outputs else (x_BTD, ys)

  cache = dict(cache)
  if model.cfg.moe_first_dense:
    x_BTD, (cache["dense_k"], cache["dense_v"]) = run(x_BTD, getattr(model, DENSE_STACKED), cache["dense_k"],
                                                     cache["dense_v"], {})
  if model.cfg.unet_skips:
    in_half = lambda x_BTD, blocks, per_unit, skips, keep_outputs: run(x_BTD, blocks, *per_unit, skips, keep_outputs)
    x_BTD, (cache["k"], cache["v"]) = unet.in_halves(in_half, x_BTD, model.blocks,
                                                     (cache["k"], cache["v"], layer_kinds(model.cfg)),
                                                     getattr(model, unet.UNET).scale[...])
  else:
    x_BTD, (cache["k"], cache["v"]) = run(x_BTD, model.blocks, cache["k"], cache["v"], layer_kinds(model.cfg))
  return model.logits(x_BTD), cache
