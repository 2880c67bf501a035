"""The one-hot MoE routing that model/moe.py replaced, kept only as the reference its tests compare to.

Dispatch and combine are (B, T, E, C) one-hots built with a (T, T) product, so
memory and work grow as T^2; the numbers are the definition the sort-based
dispatch must reproduce: the same slots, drops, outputs, statistics and gradients.
"""

import jax
import jax.numpy as jnp

from model.layers import matmul
from model.moe import AUX_LOSS, EXPERT_AXES, capacity
from model.placement import constrain, current


def route(logits_BTE, positions_T, cfg):
  """Dispatch and combine tensors (B, T, E, C) and the router statistics, all in float32."""
  b, t, e = logits_BTE.shape
  k, slots = cfg.moe_top_k, capacity(cfg, t)
  probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
  weights_BTK, experts_BTK = jax.lax.top_k(probs_BTE, k)
  if k > 1:
    weights_BTK = weights_BTK / weights_BTK.sum(-1, keepdims=True)
  chosen_KBTE = jnp.moveaxis(jax.nn.one_hot(experts_BTK, e, dtype=jnp.float32), 2, 0)
  earlier_TS = (positions_T[None, :] < positions_T[:, None]).astype(jnp.float32)
  per_round_KBE = chosen_KBTE.sum(2)
  earlier_rounds_KBE = jnp.cumsum(per_round_KBE, axis=0) - per_round_KBE
  slot_KBTE = jnp.einsum("kbse,ts->kbte", chosen_KBTE, earlier_TS) + earlier_rounds_KBE[:, :, None]
  kept_KBTE = chosen_KBTE * (slot_KBTE < slots)
  slot_KBTEC = jax.nn.one_hot(slot_KBTE.astype(jnp.int32), slots, dtype=jnp.float32) * kept_KBTE[..., None]
  dispatch_BTEC = slot_KBTEC.sum(0)
  combine_BTEC = jnp.einsum("kbtec,btk->btec", slot_KBTEC, weights_BTK)
  fraction_E = chosen_KBTE.sum((0, 1, 2)) / (b * t * k)
  stats = {
      "moe_balance_loss": e * jnp.sum(fraction_E * probs_BTE.mean((0, 1))),
      "moe_z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1))),
      "moe_dropped": 1.0 - kept_KBTE.sum() / (b * t * k),
      "expert_load": fraction_E,
  }
  return dispatch_BTEC, combine_BTEC, stats


def call(layer, x_BTD, positions_T):
  """What MoE.__call__ computed with one-hot dispatch: (output, router statistics)."""
  cfg, dtype = layer.cfg, layer.cfg.dtype
  logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), layer.router[...])
  dispatch_BTEC, combine_BTEC, stats = route(logits_BTE, positions_T, cfg)
  x_EBCD = constrain(matmul("btec,btd->ebcd", dispatch_BTEC, x_BTD, dtype), EXPERT_AXES)
  weights = layer._expert_weights()  # pylint: disable=protected-access
  run = current().experts
  y_EBCD = layer.experts(x_EBCD, *weights) if run is None else run(layer.experts, x_EBCD, weights)
  y_BTD = matmul("btec,ebcd->btd", combine_BTEC, constrain(y_EBCD, EXPERT_AXES), dtype)
  stats[AUX_LOSS] = cfg.moe_balance_weight * stats["moe_balance_loss"] + cfg.moe_z_weight * stats["moe_z_loss"]
  return y_BTD, stats
