"""Mixture-of-experts feed-forward layer: top-k router, capacity, dispatch, experts, combine.

Routing follows GShard / Switch Transformer. Each sequence is one routing
group: a token's k choices are ranked within its group, first choices of every
token before second choices, earlier positions first, and an expert keeps at
most `capacity` of them; the rest are dropped (they pass through the residual
connection unchanged). The groups never depend on the mesh, so every layout
routes and drops exactly the same tokens.

The expert computation goes through the `expert_strategy` hook: on one device
it is a batched matmul over the expert axis; parallel/experts.py installs an
all-to-all dispatch when experts are sharded over `expert`.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import INIT_STD, matmul, param, zeros
from model.sharding_hooks import constrain, expert_strategy

AUX_LOSS = "moe_aux_loss"  # the weighted balancing and z-losses, added to the training objective
EXPERT_AXES = (None, "batch", None, "embed")  # tokens laid out per expert: (expert, batch, capacity, embed)


def capacity(cfg: ModelConfig, group_size: int) -> int:
  """Slots per expert per group: capacity_factor x the fair share k T / E; the whole group when dropless."""
  return slots(group_size, cfg.num_experts, cfg.moe_top_k, cfg.moe_capacity_factor, cfg.moe_dropless)


def slots(group_size: int, experts: int, top_k: int, capacity_factor: float, dropless: bool) -> int:
  """capacity() from the numbers alone, for estimates that have a run config rather than a model."""
  if dropless:
    return group_size  # an expert can be chosen at most once per token
  return min(group_size, math.ceil(capacity_factor * group_size * top_k / experts))


def route(logits_BTE, positions_T, cfg: ModelConfig):
  """Dispatch and combine tensors (B, T, E, C) and the router statistics, all in float32."""
  b, t, e = logits_BTE.shape
  k, slots = cfg.moe_top_k, capacity(cfg, t)
  probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
  weights_BTK, experts_BTK = _top_k(probs_BTE, k)
  if k > 1:  # the chosen experts' weights sum to one (GShard, Mixtral)
    weights_BTK = weights_BTK / weights_BTK.sum(-1, keepdims=True)
  chosen_KBTE = jnp.moveaxis(jax.nn.one_hot(experts_BTK, e, dtype=jnp.float32), 2, 0)
  # Slot of each choice in its expert: the choices ranked before it, all of earlier rounds and
  # this round's at earlier positions. Positions, not array order, rank tokens, so a reordered
  # sequence (zig-zag ring) drops the same ones; a product, not a sort, keeps `batch` sharded.
  earlier_TS = (positions_T[None, :] < positions_T[:, None]).astype(jnp.float32)
  per_round_KBE = chosen_KBTE.sum(2)
  earlier_rounds_KBE = jnp.cumsum(per_round_KBE, axis=0) - per_round_KBE
  slot_KBTE = jnp.einsum("kbse,ts->kbte", chosen_KBTE, earlier_TS) + earlier_rounds_KBE[:, :, None]
  kept_KBTE = chosen_KBTE * (slot_KBTE < slots)
  slot_KBTEC = jax.nn.one_hot(slot_KBTE.astype(jnp.int32), slots, dtype=jnp.float32) * kept_KBTE[..., None]
  dispatch_BTEC = slot_KBTEC.sum(0)
  combine_BTEC = jnp.einsum("kbtec,btk->btec", slot_KBTEC, weights_BTK)
  fraction_E = chosen_KBTE.sum((0, 1, 2)) / (b * t * k)  # f_i: share of the k B T choices that went to expert i
  stats = {
      "moe_balance_loss": e * jnp.sum(fraction_E * probs_BTE.mean((0, 1))),  # = 1 when perfectly balanced
      "moe_z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1))),
      "moe_dropped": 1.0 - kept_KBTE.sum() / (b * t * k),
      "expert_load": fraction_E,  # x k B T gives the token counts; 1/E each when balanced
  }
  return dispatch_BTEC, combine_BTEC, stats


def _top_k(probs_BTE, k: int):
  """lax.top_k by k rounds of argmax: XLA partitions a reduction over a sharded batch, but
  gathers the whole batch onto every device for its TopK call. Ties go to the lower index, as in top_k."""
  weights, experts = [], []
  for _ in range(k):
    best_BT = jnp.argmax(probs_BTE, axis=-1)
    weights.append(jnp.max(probs_BTE, axis=-1))
    experts.append(best_BT)
    probs_BTE = jnp.where(jax.nn.one_hot(best_BT, probs_BTE.shape[-1], dtype=bool), -1.0, probs_BTE)
  return jnp.stack(weights, -1), jnp.stack(experts, -1)


class MoE(nnx.Module):
  """E expert copies of the family's feed-forward layer behind a learned top-k router."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f, e = cfg.embed_dim, cfg.mlp_dim, cfg.num_experts
    out_std = INIT_STD / (2 * cfg.num_layers) ** 0.5
    self.router = param(rngs, (d, e), ("embed", None))  # small: replicated, computed in float32
    self.up_kernel = param(rngs, (e, d, f), ("expert", "embed", "mlp"))
    self.down_kernel = param(rngs, (e, f, d), ("expert", "mlp", "embed"), std=out_std)
    self.gated = cfg.family == "llama"  # Llama's experts are SwiGLU, GPT-2's are GELU MLPs with biases
    if self.gated:
      self.gate_kernel = param(rngs, (e, d, f), ("expert", "embed", "mlp"))
    else:
      self.up_bias = zeros((e, f), ("expert", "mlp"))
      self.down_bias = zeros((e, d), ("expert", "embed"))
    self.cfg = cfg

  def __call__(self, x_BTD, positions_T):
    cfg, dtype = self.cfg, self.cfg.dtype
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), self.router[...])
    dispatch_BTEC, combine_BTEC, stats = route(logits_BTE, positions_T, cfg)
    x_EBCD = constrain(matmul("btec,btd->ebcd", dispatch_BTEC, x_BTD, dtype), EXPERT_AXES)
    weights = self._expert_weights()
    run = expert_strategy()
    y_EBCD = self.experts(x_EBCD, *weights) if run is None else run(self.experts, x_EBCD, weights)
    y_BTD = matmul("btec,ebcd->btd", combine_BTEC, constrain(y_EBCD, EXPERT_AXES), dtype)
    stats[AUX_LOSS] = cfg.moe_balance_weight * stats["moe_balance_loss"] + cfg.moe_z_weight * stats["moe_z_loss"]
    return y_BTD, stats

  def _expert_weights(self) -> tuple:
    if self.gated:
      return self.gate_kernel[...], self.up_kernel[...], self.down_kernel[...]
    return self.up_kernel[...], self.up_bias[...], self.down_kernel[...], self.down_bias[...]

  def experts(self, x_EBCD, *weights):
    """Each expert's feed-forward layer on its own slots; the expert axis may be a local shard."""
    dtype, fp8 = self.cfg.dtype, self.cfg.fp8
    if self.gated:
      gate_EDF, up_EDF, down_EFD = weights
      h_EBCF = jax.nn.silu(matmul("ebcd,edf->ebcf", x_EBCD, gate_EDF, dtype, fp8)) * matmul(
          "ebcd,edf->ebcf", x_EBCD, up_EDF, dtype, fp8)
      return matmul("ebcf,efd->ebcd", h_EBCF, down_EFD, dtype, fp8)
    up_EDF, up_bias_EF, down_EFD, down_bias_ED = weights
    h_EBCF = matmul("ebcd,edf->ebcf", x_EBCD, up_EDF, dtype, fp8) + up_bias_EF[:, None, None].astype(dtype)
    h_EBCF = jax.nn.gelu(h_EBCF, approximate=True)
    return matmul("ebcf,efd->ebcd", h_EBCF, down_EFD, dtype, fp8) + down_bias_ED[:, None, None].astype(dtype)


def feed_forward(layer, x_BTD, positions_T):
  """A block's feed-forward layer, dense or MoE, as (output, router statistics)."""
  return layer(x_BTD, positions_T) if isinstance(layer, MoE) else (layer(x_BTD), {})


def summarize(stats_LX: dict) -> dict:
  """Per-layer router statistics (stacked on a leading layer axis) as the run's figures."""
  if not stats_LX:
    return {}
  summary = {key: value.mean(0) for key, value in stats_LX.items()}
  summary[AUX_LOSS] = stats_LX[AUX_LOSS].sum(0)  # each MoE layer adds its own auxiliary losses
  return summary
