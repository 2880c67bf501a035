"""Mixture-of-experts feed-forward layer: top-k router, capacity, dispatch, experts, combine.

Routing follows GShard / Switch Transformer. Each sequence is one routing
group: a token's k choices are ranked within its group, first choices of every
token before second choices, earlier positions first, and an expert keeps at
most `capacity` of them; the rest are dropped (they pass through the residual
connection unchanged). The groups never depend on the mesh, so every layout
routes and drops exactly the same tokens.

Dispatch is by index, never by one-hot: one sort of a group's k T choices by
(expert, round, position) lists each expert's choices in rank order, so memory
and work grow linearly in the sequence. With a capacity, tokens are gathered
into C slots per expert per group, (E, batch, C, embed), and the experts run as
a batched matmul; dropless, the sorted tokens run as grouped matmuls
(`ragged_dot`), one group per expert. The expert computation on slots goes
through the placement's expert strategy (model/placement.py): an all-to-all
dispatch (parallel/experts.py) when experts are sharded over `expert`; there
dropless uses the slot layout with C = T, the most one group can send one expert.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import matmul, out_projection_std, param, zeros
from model.mlp import Mlp, feed_forward, weight_names
from model.placement import constrain, current, shard_mean

AUX_LOSS = "moe_aux_loss"  # the weighted balancing and z-losses, added to the training objective
ROUTER_BIAS = "router_bias"  # MoE's per-expert selection bias (moe.router_bias), which training/step.py moves
LOADS = "expert_load_by_layer"  # each MoE layer's expert loads, what moves its bias (moe.bias_rate)
EXPERT_AXES = (None, "batch", None, "embed")  # tokens laid out per expert: (expert, batch, capacity, embed)
# ragged_dot_general on rows (batch, rows, embed) sorted by expert, one list of group sizes per sequence.
_GROUPED = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([2], [1]), ([], [])),
                                             lhs_ragged_dimensions=[1], rhs_group_dimensions=[0])


def capacity(cfg: ModelConfig, group_size: int) -> int:
  """Slots per expert per group: capacity_factor x the fair share k T / E; the whole group when dropless."""
  return slots(group_size, cfg.num_experts, cfg.moe_top_k, cfg.moe_capacity_factor, cfg.moe_dropless)


def slots(group_size: int, experts: int, top_k: int, capacity_factor: float, dropless: bool) -> int:
  """capacity() from the numbers alone, for estimates that have a run config rather than a model."""
  if dropless:
    return group_size  # an expert can be chosen at most once per token
  return min(group_size, math.ceil(capacity_factor * group_size * top_k / experts))


class Routing(NamedTuple):
  """Where a group's k T choices go, as indices (choice j = t k + i is token t's i-th choice)."""
  experts_BTK: jax.Array  # the expert of each choice
  weights_BTK: jax.Array  # its weight in the combine, float32
  slot_BTK: jax.Array  # its rank among its expert's choices in the group
  sorted_BJ: jax.Array  # the group's choices in expert order, each expert's in rank order
  starts_BE: jax.Array  # where each expert's choices begin in sorted_BJ
  counts_BE: jax.Array  # how many choices each expert got


def route(logits_BTE, positions_T, cfg: ModelConfig, bias_E=None):
  """The routing of each group's choices and the router statistics, all from float32 logits.

  Scores are the softmax of the logits, or (moe.score=sigmoid, DeepSeek-V3) each logit's sigmoid. A token
  chooses its k experts by score plus `bias_E` (moe.router_bias; the choice only, never the weights), within
  the moe.group_top_k groups of experts whose two best such scores sum highest (moe.groups). The chosen
  experts' weights are their scores, renormalised to sum to one if asked, times moe.scale.
  """
  b, t, e = logits_BTE.shape
  k = cfg.moe_top_k
  if cfg.moe_score == "sigmoid":
    scores_BTE = jax.nn.sigmoid(logits_BTE)
    probs_BTE = scores_BTE / scores_BTE.sum(-1, keepdims=True)  # what the balancing loss reads
  else:
    scores_BTE = probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
  choice_BTE = scores_BTE if bias_E is None else scores_BTE + bias_E
  if cfg.moe_groups > 1:
    choice_BTE = _in_best_groups(choice_BTE, cfg.moe_groups, cfg.moe_group_top_k)
  experts_BTK = _top_k(choice_BTE, k)
  weights_BTK = jnp.take_along_axis(scores_BTE, experts_BTK, axis=-1)
  if k > 1 and cfg.moe_renormalize:  # the chosen experts' weights sum to one (GShard, Mixtral, DeepSeek-V3)
    weights_BTK = weights_BTK / (weights_BTK.sum(-1, keepdims=True) + 1e-20)
  weights_BTK = weights_BTK * cfg.moe_scale
  # Rank by (expert, round, position): positions, not array order, so a reordered sequence (zig-zag
  # ring) drops the same tokens. The sort runs along each group, so `batch` stays sharded.
  position_rank_T = jnp.argsort(jnp.argsort(positions_T))
  key_BTK = (experts_BTK * k + jnp.arange(k)) * t + position_rank_T[:, None]
  sorted_BJ = jnp.argsort(key_BTK.reshape(b, t * k), axis=-1)
  counts_BE = jnp.sum(jax.nn.one_hot(experts_BTK, e, dtype=jnp.int32), axis=(1, 2))
  starts_BE = jnp.cumsum(counts_BE, axis=-1) - counts_BE
  place_BJ = jnp.argsort(sorted_BJ, axis=-1)  # each choice's place in the sorted list
  slot_BTK = place_BJ.reshape(b, t, k) - _per_choice(starts_BE, experts_BTK)
  # The figures are of the whole batch, wherever it is split: a pipeline stage holds one shard of its rows.
  whole = lambda x: shard_mean(x, "batch", "length")
  fraction_E = whole(counts_BE.sum(0) / (b * t * k))  # f_i: share of the k B T choices that went to expert i
  stats = {
      "moe_balance_loss": e * jnp.sum(fraction_E * whole(probs_BTE.mean((0, 1)))),  # = 1 when perfectly balanced
      "moe_z_loss": whole(jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)))),
      "moe_dropped": 1.0 - whole(jnp.minimum(counts_BE, capacity(cfg, t)).sum() / (b * t * k)),
      "expert_load": fraction_E,  # x k B T gives the token counts; 1/E each when balanced
      **({LOADS: fraction_E} if cfg.moe_bias_rate else {}),
  }
  return Routing(experts_BTK, weights_BTK, slot_BTK, sorted_BJ, starts_BE, counts_BE), stats


def _per_choice(per_expert_BE, experts_BTK):
  """Each choice's entry of a per-expert, per-group array."""
  b, t, k = experts_BTK.shape
  return jnp.take_along_axis(per_expert_BE, experts_BTK.reshape(b, t * k), axis=1).reshape(b, t, k)


def _top_k(scores_BTX, k: int):
  """The indices of lax.top_k by k rounds of argmax: XLA partitions a reduction over a sharded batch, but
  gathers the whole batch onto every device for its TopK call. Ties go to the lower index, as in top_k."""
  chosen = []
  for _ in range(k):
    best_BT = jnp.argmax(scores_BTX, axis=-1)
    chosen.append(best_BT)
    scores_BTX = jnp.where(jax.nn.one_hot(best_BT, scores_BTX.shape[-1], dtype=bool), -jnp.inf, scores_BTX)
  return jnp.stack(chosen, -1)


def _in_best_groups(choice_BTE, groups: int, chosen: int):
  """`choice_BTE` with the experts outside each token's `chosen` best of `groups` equal groups at -inf, a group
  ranked by the sum of its two best scores (DeepSeek-V3's group-limited routing)."""
  b, t, e = choice_BTE.shape
  grouped_BTGX = choice_BTE.reshape(b, t, groups, e // groups)
  best_two_BTG = jnp.take_along_axis(grouped_BTGX, _top_k(grouped_BTGX, 2), axis=-1).sum(-1)
  kept_BTG = jnp.any(jax.nn.one_hot(_top_k(best_two_BTG, chosen), groups, dtype=bool), axis=-2)
  return jnp.where(kept_BTG[..., None], grouped_BTGX, -jnp.inf).reshape(b, t, e)


def _gather_rows(x_BSD, rows_BR):
  """x_BSD[b, rows_BR[b]]: a gather within each group, so XLA keeps `batch` sharded."""
  return jnp.take_along_axis(x_BSD, rows_BR[..., None], axis=1)


def dispatch(x_BTD, routing: Routing, slots: int):
  """Tokens in their experts' slots, (E, B, C, D); a slot past its expert's count holds zeros."""
  b, t, k = routing.experts_BTK.shape
  e = routing.counts_BE.shape[1]
  slot_C = jnp.arange(slots)
  filled_BEC = slot_C < routing.counts_BE[..., None]
  place_BEC = jnp.minimum(routing.starts_BE[..., None] + slot_C, t * k - 1)
  choice_BR = jnp.take_along_axis(routing.sorted_BJ, place_BEC.reshape(b, e * slots), axis=1)
  x_BRD = _gather_rows(x_BTD, choice_BR // k) * filled_BEC.reshape(b, e * slots, 1)
  return jnp.moveaxis(x_BRD.reshape(b, e, slots, -1), 1, 0)


def combine(y_BRD, row_BTK, kept_BTK, weights_BTK, dtype):
  """Each token's sum of its kept choices' rows of y_BRD, weighted by the router, in float32."""
  b, t, k = row_BTK.shape
  y_BTKD = _gather_rows(y_BRD, row_BTK.reshape(b, t * k)).reshape(b, t, k, -1)
  return jnp.einsum("btkd,btk->btd", y_BTKD.astype(jnp.float32), weights_BTK * kept_BTK).astype(dtype)


def grouped_matmul(sizes_BE, dtype):
  """Rows sorted by expert (B, R, D) times per-expert weights (E, D, F): ragged_dot, float32 accumulation."""
  def dot(x_BRD, w_EDF):
    return jax.lax.ragged_dot_general(x_BRD.astype(dtype), w_EDF.astype(dtype), sizes_BE, _GROUPED,
                                      preferred_element_type=jnp.float32).astype(dtype)
  return dot


class MoE(nnx.Module):
  """E expert copies of the family's feed-forward layer behind a learned top-k router (and, with
  moe_shared_width, one shared expert every token passes through, scaled by a learned sigmoid gate)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f, e = cfg.embed_dim, cfg.mlp_dim, cfg.num_experts
    out_std = out_projection_std(cfg)
    self.router = param(rngs, (d, e), ("embed", None))  # small: replicated, computed in float32
    self.up_kernel = param(rngs, (e, d, f), ("expert", "embed", "mlp"))
    self.down_kernel = param(rngs, (e, f, d), ("expert", "mlp", "embed"), std=out_std)
    if cfg.traits.gated_mlp:
      self.gate_kernel = param(rngs, (e, d, f), ("expert", "embed", "mlp"))
    if cfg.traits.biases:
      self.up_bias = zeros((e, f), ("expert", "mlp"))
      self.down_bias = zeros((e, d), ("expert", "embed"))
    if cfg.moe_shared_width:  # the family's SwiGLU, every token through it, sigmoid-gated (Qwen2-MoE) or not
      self.shared = Mlp(dataclasses.replace(cfg, mlp_dim=cfg.moe_shared_width), rngs)
      if cfg.moe_shared_gate:
        self.shared_gate_kernel = param(rngs, (d, 1), ("embed", None))
    if cfg.moe_router_bias:  # moved by training/step.py, not by gradients: it changes the choice only
      self.router_bias = zeros((e,), (None,))
    self.cfg = cfg

  def __call__(self, x_BTD, positions_T):
    cfg, dtype = self.cfg, self.cfg.dtype
    # A router ranks and drops a whole sequence's tokens: where this holds one shard of each sequence (a
    # pipeline stage over a sharded sequence), it routes the gathered sequence and keeps its own part.
    x_BTD, positions_T, local = current().whole_length(x_BTD, positions_T)
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), self.router[...])
    routing, stats = route(logits_BTE, positions_T, cfg, self.router_bias[...] if cfg.moe_router_bias else None)
    weights, run = self._expert_weights(), current().experts
    if cfg.moe_dropless and run is None:  # every choice kept: the sorted tokens, one group per expert
      x_BJD = _gather_rows(x_BTD.astype(dtype), routing.sorted_BJ // cfg.moe_top_k)
      y_BRD = self.experts(x_BJD, *weights, groups=routing)  # row j: the j-th sorted choice
      rows_BTK, kept_BTK = routing.slot_BTK + _per_choice(routing.starts_BE, routing.experts_BTK), 1.0
    else:
      slots = capacity(cfg, x_BTD.shape[1])
      x_EBCD = constrain(dispatch(x_BTD.astype(dtype), routing, slots), EXPERT_AXES)
      y_EBCD = self.experts(x_EBCD, *weights) if run is None else run(self.experts, x_EBCD, weights)
      e, b, _, d = y_EBCD.shape
      y_BRD = jnp.moveaxis(constrain(y_EBCD, EXPERT_AXES), 0, 1).reshape(b, e * slots, d)  # row e C + c
      kept_BTK = routing.slot_BTK < slots
      rows_BTK = routing.experts_BTK * slots + jnp.minimum(routing.slot_BTK, slots - 1)
    y_BTD = combine(y_BRD, rows_BTK, kept_BTK, routing.weights_BTK, dtype)
    if cfg.moe_shared_width:
      shared_BTD = self.shared(x_BTD.astype(dtype)).astype(jnp.float32)
      if cfg.moe_shared_gate:
        shared_BTD = shared_BTD * jax.nn.sigmoid(
            matmul("btd,do->bto", x_BTD, self.shared_gate_kernel[...], dtype).astype(jnp.float32))
      y_BTD = y_BTD + shared_BTD.astype(dtype)
    stats[AUX_LOSS] = cfg.moe_balance_weight * stats["moe_balance_loss"] + cfg.moe_z_weight * stats["moe_z_loss"]
    return local(y_BTD), stats

  def _expert_weights(self) -> tuple:
    return tuple(getattr(self, name)[...] for name in weight_names(self.cfg))

  def experts(self, x, *weights, groups: Routing | None = None):
    """Each expert's feed-forward layer: on its slots x_EBCD (the expert axis may be a local shard), or
    with `groups`, on rows x_BJD sorted by expert."""
    dtype, fp8 = self.cfg.dtype, self.cfg.fp8
    if groups is None:
      dot = lambda x_EBCD, w_EDF: matmul("ebcd,edf->ebcf", x_EBCD, w_EDF, dtype, fp8)
      bias = lambda b_EF: b_EF[:, None, None].astype(dtype)
    else:
      dot = grouped_matmul(groups.counts_BE, dtype)
      expert_BJ = jnp.take_along_axis(groups.experts_BTK.reshape(x.shape[:2]), groups.sorted_BJ, axis=1)
      bias = lambda b_EF: b_EF[expert_BJ].astype(dtype)
    return feed_forward(self.cfg, x, weights, dot, dot, bias)


def summarize(stats_LX: dict) -> dict:
  """Per-layer router statistics (stacked on a leading layer axis) as the run's figures."""
  if not stats_LX:
    return {}
  summary = {key: value.mean(0) for key, value in stats_LX.items()}
  summary[AUX_LOSS] = stats_LX[AUX_LOSS].sum(0)  # each MoE layer adds its own auxiliary losses
  if LOADS in stats_LX:  # each layer's own, for its own bias
    summary[LOADS] = stats_LX[LOADS]
  return summary
