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
  2S-1-i of 2S) so every device has the same causal work.
- ulysses: an all-to-all trades the sequence split for a head split, each
  device attends over the whole sequence for N/S heads, and an all-to-all trades back.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from model.attention import attention_block
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

  def attend(q_BTNH, k_BTKH, v_BTKH, positions_T):
    return jax.shard_map(body, mesh=mesh, in_specs=(_ACTIVATION, _ACTIVATION, _ACTIVATION, P(SEQUENCE)),
                         out_specs=_ACTIVATION, axis_names={EXPERT, DATA, SEQUENCE})(q_BTNH, k_BTKH, v_BTKH, positions_T)

  return attend


def _allgather(q_BTNH, k_BTKH, v_BTKH, positions_T):
  gather = lambda x, axis: jax.lax.all_gather(x, SEQUENCE, axis=axis, tiled=True)
  out_BTNH, _, _ = attention_block(q_BTNH, gather(k_BTKH, 1), gather(v_BTKH, 1), positions_T,
                                   gather(positions_T, 0))
  return out_BTNH


def _ring(q_BTNH, k_BTKH, v_BTKH, positions_T):
  shards = jax.lax.axis_size(SEQUENCE)
  ring = [(i, (i + 1) % shards) for i in range(shards)]
  b, t, n, h = q_BTNH.shape
  out_BTNH, max_BKGT, sum_BKGT = attention_block(q_BTNH, k_BTKH, v_BTKH, positions_T, positions_T)
  out_BTNH = out_BTNH.astype(jnp.float32)
  block = (k_BTKH, v_BTKH, positions_T)
  # Recompute each visiting block in the backward pass rather than keep its T/S x T/S
  # probabilities: otherwise the ring would save as much as gathering all of K/V.
  visit = jax.checkpoint(attention_block)
  for _ in range(shards - 1):
    block = jax.lax.ppermute(block, SEQUENCE, ring)
    block_out_BTNH, block_max_BKGT, block_sum_BKGT = visit(q_BTNH, *block[:2], positions_T, block[2])
    # Online softmax: rescale both partial results to the new running maximum, weight by their sums.
    new_max_BKGT = jnp.maximum(max_BKGT, block_max_BKGT)
    old_weight_BKGT = jnp.exp(max_BKGT - new_max_BKGT) * sum_BKGT
    block_weight_BKGT = jnp.exp(block_max_BKGT - new_max_BKGT) * block_sum_BKGT
    sum_BKGT = old_weight_BKGT + block_weight_BKGT
    as_heads = lambda w_BKGT: jnp.moveaxis(w_BKGT, -1, 1).reshape(b, t, n)[..., None]
    safe_sum = jnp.maximum(sum_BKGT, 1e-30)
    out_BTNH = (out_BTNH * as_heads(old_weight_BKGT / safe_sum)
                + block_out_BTNH.astype(jnp.float32) * as_heads(block_weight_BKGT / safe_sum))
    max_BKGT = new_max_BKGT
  return out_BTNH.astype(q_BTNH.dtype)


def _ulysses(q_BTNH, k_BTKH, v_BTKH, positions_T):
  to_heads = lambda x: jax.lax.all_to_all(x, SEQUENCE, split_axis=2, concat_axis=1, tiled=True)
  positions_all = jax.lax.all_gather(positions_T, SEQUENCE, tiled=True)
  out_BTnH, _, _ = attention_block(to_heads(q_BTNH), to_heads(k_BTKH), to_heads(v_BTKH),
                                   positions_all, positions_all)
  return jax.lax.all_to_all(out_BTnH, SEQUENCE, split_axis=1, concat_axis=2, tiled=True)
