"""Context parallelism: attention over a `length` sharded on `sequence`, three ways.

Each strategy is a `shard_map` manual over `sequence` and over the batch's
axes (`expert`, `data`), whose rows stay local: left to GSPMD inside the map,
the batch would be gathered over `data` for the collectives over `sequence`.
`tensor` keeps working inside under GSPMD, splitting heads. Queries, keys and values arrive
with rotary positions already applied, and the causal mask comes from token
positions, so the strategies are exact whatever order the sequence is in.

- allgather: gather every key and value, attend locally. Simple; K/V memory is the whole sequence.
- ring: K/V blocks travel round the ring with `ppermute` while each device
  merges them into its queries' output with an online softmax; K/V memory is
  one block. The sequence is laid out zig-zag (device i holds chunks i and
  2S-1-i of 2S, training/step.py) so every device has the same causal work,
  and each visiting block's fully masked half is skipped, not computed under a mask.
- ulysses: an all-to-all trades the sequence split for a head split, each
  device attends over the whole sequence for N/S heads, and an all-to-all trades back.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from model.attention import blockwise_attention, merge_blocks
from parallel.mesh import DATA, EXPERT, SEQUENCE

STRATEGIES = ("allgather", "ring", "ulysses")
_ACTIVATION = P((EXPERT, DATA), SEQUENCE)  # (batch, length, ...) as parallel/rules.py lays activations out


def zigzag_order(length: int, shards: int) -> np.ndarray:
  """Token order that gives shard i chunks i and 2S-1-i of 2S equal chunks (balanced causal work)."""
  chunks = np.arange(length).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def strategy(name: str, mesh):
  """The attention function the model's hook calls for context strategy `name`."""
  body = {"allgather": _allgather, "ring": _ring, "ulysses": _ulysses}[name]

  def attend(q_BTNH, k_BTKH, v_BTKH, positions_T, block):
    return jax.shard_map(functools.partial(body, block=block), mesh=mesh, in_specs=(_ACTIVATION, _ACTIVATION, _ACTIVATION, P(SEQUENCE)),
                         out_specs=_ACTIVATION, axis_names={EXPERT, DATA, SEQUENCE})(q_BTNH, k_BTKH, v_BTKH, positions_T)

  return attend


def _allgather(q_BTNH, k_BTKH, v_BTKH, positions_T, block):
  gather = lambda x, axis: jax.lax.all_gather(x, SEQUENCE, axis=axis, tiled=True)
  out_BTNH, _ = blockwise_attention(q_BTNH, gather(k_BTKH, 1), gather(v_BTKH, 1), positions_T,
                                       gather(positions_T, 0), block)
  return out_BTNH


def _ring(q_BTNH, k_BTKH, v_BTKH, positions_T, block):
  shards, me = jax.lax.axis_size(SEQUENCE), jax.lax.axis_index(SEQUENCE)
  ring = [(i, (i + 1) % shards) for i in range(shards)]
  merged = blockwise_attention(q_BTNH, k_BTKH, v_BTKH, positions_T, positions_T, block)
  kv_block = (k_BTKH, v_BTKH, positions_T)
  # Recompute each visiting block in the backward pass rather than keep its T/S x T/S
  # probabilities: otherwise the ring would save as much as gathering all of K/V.
  visit = jax.checkpoint(_visit, static_argnums=(5,))
  for hop in range(1, shards):
    kv_block = jax.lax.ppermute(kv_block, SEQUENCE, ring)
    merged = merge_blocks(merged, visit(q_BTNH, *kv_block, positions_T, block, me < hop))
  return merged[0].astype(q_BTNH.dtype)


def _visit(q_BTNH, k_BTKH, v_BTKH, k_positions_T, q_positions_T, block, from_later):
  """One visiting K/V block's share of the zig-zag ring: half the scores of a full block, none masked out.

  Device i holds chunks i and 2S-1-i (halves 1 and 2 below); the visitor j holds j and 2S-1-j.
  Local half 2 always sees the visitor's half 1. Besides that, from an earlier device (j < i)
  local half 1 sees visitor half 1; from a later one (j > i) local half 2 sees visitor half 2.
  That second pair is picked by a dynamic slice, not a branch, so every device runs the same
  two quarter-blocks and skips the two that are fully masked.
  """
  half = q_BTNH.shape[1] // 2
  start = from_later.astype(jnp.int32) * half
  take = lambda x, axis=1: jax.lax.dynamic_slice_in_dim(x, start, half, axis)
  always = blockwise_attention(q_BTNH[:, half:], k_BTKH[:, :half], v_BTKH[:, :half], q_positions_T[half:],
                               k_positions_T[:half], block)
  picked = blockwise_attention(take(q_BTNH), take(k_BTKH), take(v_BTKH), take(q_positions_T, 0),
                               take(k_positions_T, 0), block)
  # A row that sees nothing: out 0 and the lowest log-sum-exp, so it weighs nothing in a merge.
  unseen = (picked[0] * 0, picked[1] * 0 + jnp.finfo(jnp.float32).min)
  pick = lambda use: jax.tree.map(lambda a, b: jnp.where(use, a, b), picked, unseen)
  first_out, first_lse = pick(~from_later)
  second_out, second_lse = merge_blocks(always, pick(from_later))
  return (jnp.concatenate([first_out.astype(jnp.float32), second_out], axis=1),
          jnp.concatenate([first_lse, second_lse], axis=-1))


def _ulysses(q_BTNH, k_BTKH, v_BTKH, positions_T, block):
  to_heads = lambda x: jax.lax.all_to_all(x, SEQUENCE, split_axis=2, concat_axis=1, tiled=True)
  positions_all = jax.lax.all_gather(positions_T, SEQUENCE, tiled=True)
  out_BTnH, _ = blockwise_attention(to_heads(q_BTNH), to_heads(k_BTKH), to_heads(v_BTKH),
                                       positions_all, positions_all, block)
  return jax.lax.all_to_all(out_BTnH, SEQUENCE, split_axis=1, concat_axis=2, tiled=True)
