"""Context parallelism: attention over a `length` sharded on `sequence`, three ways.

Each strategy is a `shard_map` manual over `sequence` and over the batch's
axes (`expert`, `data`), whose rows stay local: left to GSPMD inside the map,
the batch would be gathered over `data` for the collectives over `sequence`.
`tensor` is manual too, each device attending its own heads (left to GSPMD,
the heads would be gathered over it around every collective over
`sequence`). Queries, keys and values arrive with rotary positions already
applied, and the causal mask comes from token positions, so the strategies
are exact whatever order the sequence is in.

- allgather: gather every key and value, attend locally. Simple; K/V memory is the whole sequence.
- ring: K/V blocks travel round the ring with `ppermute` while each device
  merges them into its queries' output with an online softmax; K/V memory is
  one block. The sequence is laid out zig-zag (device i holds chunks i and
  2S-1-i of 2S, training/step.py) so every device has the same causal work,
  and each visiting block's fully masked half is skipped, not computed under a mask.
- ulysses: an all-to-all trades the sequence split for a head split, each
  device attends over the whole sequence for N/S heads, and an all-to-all trades back.

Packed documents: each token's segment id travels with its key wherever the
key goes (gathered, round the ring in the visiting block, gathered whole for
Ulysses' heads), so a query sees only keys of its own document on every strategy.

STRATEGIES holds each strategy's body beside its costs (parallel/costs.py's
terms), which measure/ composes: a strategy is added there, with its costs.
"""

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from model.attention import blockwise_attention, flash_gradients, merge_blocks
from parallel.costs import F32_BYTES, INT32_BYTES, Dims, gather
from parallel.mesh import SEQUENCE, TENSOR
from parallel.rules import BATCH_AXES

_ACTIVATION = P(BATCH_AXES, SEQUENCE)  # (batch, length, ...) as parallel/rules.py lays activations out


def zigzag_order(length: int, shards: int) -> np.ndarray:
  """Token order that gives shard i chunks i and 2S-1-i of 2S equal chunks (balanced causal work)."""
  chunks = np.arange(length).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A context strategy: its attention, and what it costs per layer on `shards` devices over `sequence`."""
  body: Callable  # attention inside a map manual over `sequence` and the batch's axes
  # {(kind, axis): (bytes one device sends in a layer's forward pass, in its backward pass)}
  sent: Callable[[Dims, int], dict[tuple[str, str], tuple[int, int]]]
  calls: Callable[[int], int]  # its collectives per layer and pass
  held: Callable[[Dims], int]  # bytes a layer's backward pass holds beyond blockwise attention's own
  # The keys visit a block at a time (the ring): a query scores one block at once, the backward pass is
  # the strategy's own and recomputes each visitor's scores from the log-sum-exp, every device runs the
  # hops together (a pipeline stage computes on every tick of its slots), and the sequence is laid out
  # zig-zag so each visitor's fully masked half is skipped.
  visiting: bool = False


def token_order(strategy_name: str, length: int, shards: int) -> np.ndarray | None:
  """The order a strategy wants the sequence in (zig-zag for the ring), or None for token order."""
  return zigzag_order(length, shards) if visiting(strategy_name) else None


def scored_flops(strategy_name: str, flops: int, shards: int) -> int:
  """Of attention's FLOPs over the whole T x T, those a strategy runs: the zig-zag ring computes its own
  block whole and half of each of the S - 1 visitors (the rest is masked)."""
  return flops * (shards + 1) // (2 * shards) if visiting(strategy_name) else flops


def visiting(strategy_name: str) -> bool:
  """Whether the keys visit a block at a time ("none", one shard: no)."""
  return strategy_name in STRATEGIES and STRATEGIES[strategy_name].visiting


def strategy(name: str, mesh):
  """The attention function of context strategy `name` (model/placement.py `attention`)."""
  return _attend(STRATEGIES[name].body, mesh, (*BATCH_AXES, SEQUENCE), _ACTIVATION, P(SEQUENCE))


def in_map(name: str):
  """Strategy `name`'s attention inside a map already manual over `sequence` and the batch's axes (a
  pipeline stage's): the body `strategy` maps, where no map over those can nest.

  The heads stay under GSPMD there, which gathers them over `tensor` around each collective over
  `sequence` (tensor x the bytes, and an all-gather of their own). A map over `tensor` alone inside the
  stage would keep them apart, but JAX 0.11 cannot differentiate a nested map that runs a collective
  over its parent's manual axis (its partial evaluation names a residual by that axis, which Shardy
  rejects: "parent bounding this axis as manual").
  """
  return STRATEGIES[name].body


def _attend(body, mesh, axes: tuple, rows: P, positions: P):
  """`body` in a map manual over `axes` (rows and positions split as `rows` and `positions` say) and over
  `tensor`, whose heads attend apart: left to GSPMD inside, the heads would be gathered over `tensor`
  before every collective over `sequence` (tensor x the bytes, and an all-gather of their own)."""
  heads = P(*rows, TENSOR)

  def attend(q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT=None, *, block, window=0, softcap=0.0):
    inputs = (q_BTNH, k_BTKH, v_BTKH, positions_T) + (() if segments_BT is None else (segments_BT,))
    in_specs = (heads, heads, heads, positions, rows)[:len(inputs)]
    return jax.shard_map(functools.partial(body, block=block, window=window, softcap=softcap), mesh=mesh,
                         in_specs=in_specs, out_specs=heads, axis_names={*axes, TENSOR})(*inputs)

  return attend


def whole_length(x_BTX, positions_T):
  """Inside a map manual over `sequence`: the whole sequence gathered from its shards (in the order they hold
  it), its positions, and the function that keeps this shard's part of a result (model/placement.py)."""
  length = x_BTX.shape[1]
  start = jax.lax.axis_index(SEQUENCE) * length
  return (_gather(x_BTX, 1), _gather(positions_T, 0),
          lambda y_BTX: jax.lax.dynamic_slice_in_dim(y_BTX, start, length, axis=1))


def per_device(mesh):
  """The runner of attention kernels the partitioner cannot split (model/placement.py `per_device`).

  Each device attends its own rows (BATCH_AXES) and heads (`tensor`); a
  kernel that runs this way needs the whole sequence on each device, outside
  a pipeline's stages (parallel/checks.py).
  """
  spec = P(BATCH_AXES, None, TENSOR)

  def run(kernel, q_BTNH, k_BTKH, v_BTKH, *per_row):
    # Pallas kernels do not state how their outputs vary over the manual axes: every one does, per device.
    # Arrays after the heads' (packed documents' segment ids, [B, T]) follow the rows alone.
    return jax.shard_map(kernel, mesh=mesh, in_specs=(spec, spec, spec) + (P(BATCH_AXES),) * len(per_row),
                         out_specs=spec, axis_names={*BATCH_AXES, TENSOR}, check_vma=False)(
                             q_BTNH, k_BTKH, v_BTKH, *per_row)

  return run


def _gather(x, axis):
  return jax.lax.all_gather(x, SEQUENCE, axis=axis, tiled=True)


def _pair(q_segments_BT, k_segments_BS):
  """blockwise_attention's `segments` for these queries and keys: None without packing."""
  return None if q_segments_BT is None else (q_segments_BT, k_segments_BS)


def _allgather(q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT=None, *, block, window=0, softcap=0.0):
  segments = None if segments_BT is None else (segments_BT, _gather(segments_BT, 1))
  out_BTNH, _ = blockwise_attention(q_BTNH, _gather(k_BTKH, 1), _gather(v_BTKH, 1), positions_T,
                                    _gather(positions_T, 0), block, segments, window, softcap)
  return out_BTNH


def _ring(q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT=None, *, block, window=0, softcap=0.0):
  out_BTNH, _ = _ring_attention((block, window, softcap), q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT)
  return out_BTNH


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(kernel, q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT):
  return _ring_forward(kernel, q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT)[0]


def _ring_forward(kernel, q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT):
  """Each K/V block visits every device once; its queries merge what they see by log-sum-exp.

  Saves only this device's Q, K, V, output and log-sum-exp, as flash attention does: the
  backward pass sends the blocks round again rather than keep S - 1 visitors' worth. A visiting
  block carries its keys' segment ids (None without packing). `kernel` is (block, window, softcap) as
  blockwise_attention takes them.
  """
  shards, me = jax.lax.axis_size(SEQUENCE), jax.lax.axis_index(SEQUENCE)
  first = blockwise_attention(q_BTNH, k_BTKH, v_BTKH, positions_T, positions_T, kernel[0],
                              _pair(segments_BT, segments_BT), *kernel[1:])

  def hop(carry, hop):  # a scan, not a Python loop, so one visitor's buffers live at a time
    merged, kv_block = carry
    kv_block = jax.lax.ppermute(kv_block, SEQUENCE, _next(shards))
    visit = _visit(q_BTNH, *kv_block, positions_T, segments_BT, kernel, me < hop)
    return (merge_blocks(merged, visit), kv_block), None

  start = ((first[0].astype(jnp.float32), first[1]), (k_BTKH, v_BTKH, positions_T, segments_BT))
  (merged, _), _ = jax.lax.scan(hop, start, jnp.arange(1, shards))
  out_BTNH, lse_BKGT = merged[0].astype(q_BTNH.dtype), merged[1]
  return (out_BTNH, lse_BKGT), (q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT, out_BTNH, lse_BKGT)


def _ring_backward(kernel, saved, cotangents):
  """Ring attention's backward: each K/V block goes round again, carrying the gradients of its keys and
  values, to which every device adds its queries' share (flash attention's backward against this
  device's saved output and log-sum-exp); one last hop brings them home."""
  q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT, out_BTNH, lse_BKGT = saved
  shards, me = jax.lax.axis_size(SEQUENCE), jax.lax.axis_index(SEQUENCE)
  rows = (q_BTNH, positions_T, out_BTNH, lse_BKGT, *cotangents)
  d_q_BTNH, d_k_BTKH, d_v_BTKH = flash_gradients(kernel[0], rows, (k_BTKH, v_BTKH, positions_T),
                                                 _pair(segments_BT, segments_BT), *kernel[1:])

  def hop(carry, hop):
    d_q_BTNH, (keys, k_segments_BT, d_k_BTKH, d_v_BTKH) = carry
    keys, k_segments_BT, d_k_BTKH, d_v_BTKH = jax.lax.ppermute(
        (keys, k_segments_BT, d_k_BTKH, d_v_BTKH), SEQUENCE, _next(shards))
    d_q, d_k, d_v = _visit_gradients(rows, keys, segments_BT, k_segments_BT, kernel, me < hop)
    return (d_q_BTNH + d_q, (keys, k_segments_BT, d_k_BTKH + d_k, d_v_BTKH + d_v)), None

  start = (d_q_BTNH, ((k_BTKH, v_BTKH, positions_T), segments_BT, d_k_BTKH, d_v_BTKH))
  (d_q_BTNH, (_, _, d_k_BTKH, d_v_BTKH)), _ = jax.lax.scan(hop, start, jnp.arange(1, shards))
  d_k_BTKH, d_v_BTKH = jax.lax.ppermute((d_k_BTKH, d_v_BTKH), SEQUENCE, _next(shards))
  return (d_q_BTNH.astype(q_BTNH.dtype), d_k_BTKH.astype(k_BTKH.dtype), d_v_BTKH.astype(v_BTKH.dtype), None, None)


_ring_attention.defvjp(_ring_forward, _ring_backward)


def _next(shards: int):
  return [(i, (i + 1) % shards) for i in range(shards)]


def _visit(q_BTNH, k_BTKH, v_BTKH, k_positions_T, k_segments_BT, q_positions_T, q_segments_BT, kernel, from_later):
  """One visiting K/V block's share of the zig-zag ring: half the scores of a full block, none masked out.

  Device i holds chunks i and 2S-1-i (halves 1 and 2 below); the visitor j holds j and 2S-1-j.
  Local half 2 always sees the visitor's half 1. Besides that, from an earlier device (j < i)
  local half 1 sees visitor half 1; from a later one (j > i) local half 2 sees visitor half 2.
  That second pair is picked by a dynamic slice, not a branch, so every device runs the same
  two quarter-blocks and skips the two that are fully masked.
  """
  half, _, take = _halves(q_BTNH, from_later)
  packed = q_segments_BT is not None
  block, window, softcap = kernel
  always = blockwise_attention(q_BTNH[:, half:], k_BTKH[:, :half], v_BTKH[:, :half], q_positions_T[half:],
                               k_positions_T[:half], block,
                               _pair(q_segments_BT[:, half:], k_segments_BT[:, :half]) if packed else None, window,
                               softcap)
  picked = blockwise_attention(take(q_BTNH), take(k_BTKH), take(v_BTKH), take(q_positions_T, 0),
                               take(k_positions_T, 0), block,
                               _pair(take(q_segments_BT), take(k_segments_BT)) if packed else None, window, softcap)
  # A row that sees nothing: out 0 and the lowest log-sum-exp, so it weighs nothing in a merge.
  unseen = (picked[0] * 0, picked[1] * 0 + jnp.finfo(jnp.float32).min)
  pick = lambda use: jax.tree.map(lambda a, b: jnp.where(use, a, b), picked, unseen)
  first_out, first_lse = pick(~from_later)
  second_out, second_lse = merge_blocks(always, pick(from_later))
  return (jnp.concatenate([first_out.astype(jnp.float32), second_out], axis=1),
          jnp.concatenate([first_lse, second_lse], axis=-1))


def _visit_gradients(rows, kv_block, q_segments_BT, k_segments_BT, kernel, from_later):
  """`_visit`'s two quarter-blocks differentiated: float32 (dQ, dK, dV) of this device's rows and the
  visitor's block."""
  half, start, take = _halves(rows[0], from_later)
  # The sequence axes of q, positions, out, lse, dOut, dLse; and of k, v, positions.
  row_axes, kv_axes = (1, 0, 1, -1, 1, -1), (1, 1, 0)
  part = lambda xs, axes, begin: [jax.lax.slice_in_dim(x, begin, begin + half, axis=a % x.ndim)
                                  for x, a in zip(xs, axes)]
  packed, (block, window, softcap) = q_segments_BT is not None, kernel
  # Local half 2 against the visitor's half 1, always; the picked pair by the same dynamic slice as forward.
  always = flash_gradients(block, part(rows, row_axes, half), part(kv_block, kv_axes, 0),
                           _pair(q_segments_BT[:, half:], k_segments_BT[:, :half]) if packed else None, window,
                           softcap)
  picked = flash_gradients(block, [take(x, a) for x, a in zip(rows, row_axes)],
                           [take(x, a) for x, a in zip(kv_block, kv_axes)],
                           _pair(take(q_segments_BT), take(k_segments_BT)) if packed else None, window, softcap)
  add_picked = lambda whole, add: jax.lax.dynamic_update_slice_in_dim(
      whole, jax.lax.dynamic_slice_in_dim(whole, start, half, 1) + add, start, 1)
  zeros = lambda x: x.astype(jnp.float32) * 0  # from the inputs, so it keeps their varying axes
  d_q = add_picked(zeros(rows[0]).at[:, half:].set(always[0]), picked[0])
  d_k = add_picked(zeros(kv_block[0]).at[:, :half].set(always[1]), picked[1])
  d_v = add_picked(zeros(kv_block[1]).at[:, :half].set(always[2]), picked[2])
  return d_q, d_k, d_v


def _halves(q_BTNH, from_later):
  """Half the local length, where the half `from_later` picks starts (the second if true), and its slice."""
  half = q_BTNH.shape[1] // 2
  start = from_later.astype(jnp.int32) * half
  return half, start, lambda x, axis=1: jax.lax.dynamic_slice_in_dim(x, start, half, axis % x.ndim)


def _ulysses(q_BTNH, k_BTKH, v_BTKH, positions_T, segments_BT=None, *, block, window=0, softcap=0.0):
  to_heads = lambda x: jax.lax.all_to_all(x, SEQUENCE, split_axis=2, concat_axis=1, tiled=True)
  positions_all = _gather(positions_T, 0)
  # Every head of a row shares the row's segments: gathered whole, as the positions are.
  segments_all = None if segments_BT is None else _gather(segments_BT, 1)
  out_BTnH, _ = blockwise_attention(to_heads(q_BTNH), to_heads(k_BTKH), to_heads(v_BTKH),
                                    positions_all, positions_all, block, _pair(segments_all, segments_all), window,
                                    softcap)
  return jax.lax.all_to_all(out_BTnH, SEQUENCE, split_axis=1, concat_axis=2, tiled=True)


def _kv_bytes(d: Dims) -> int:
  """This shard's keys (or values) in the compute dtype."""
  return d.activation_bytes(d.kv_heads * d.head_dim)


def _allgather_sent(d: Dims, shards: int) -> dict:
  """K and V gathered forward, their gradients reduce-scattered backward."""
  both = 2 * gather(_kv_bytes(d) * shards, shards)
  return {("all-gather", SEQUENCE): (both, 0), ("reduce-scatter", SEQUENCE): (0, both)}


def _allgather_held(d: Dims) -> int:
  """The whole sequence's keys and values as gathered, in the compute dtype; below float32 also as the
  blocks the attention scans and as their gradients cast back for the reduce-scatter (in float32 the scan
  reads the gathered buffer itself, and the gradients are blockwise attention's float32 ones)."""
  narrow = int(d.compute_bytes < F32_BYTES)
  return (1 + 2 * narrow) * 2 * d.batch * d.keys * d.kv_heads * d.head_dim * d.compute_bytes


def _ring_sent(d: Dims, shards: int) -> dict:
  """S-1 hops of a K/V block (with its positions) forward; backward, S-1 hops of the block with its
  float32 gradients and one more of the gradients alone."""
  block = 2 * _kv_bytes(d) + d.length * INT32_BYTES
  gradients = 2 * d.tokens * d.kv_heads * d.head_dim * F32_BYTES
  return {("collective-permute", SEQUENCE): ((shards - 1) * block, (shards - 1) * (block + gradients) + gradients)}


def _ring_held(d: Dims) -> int:
  """The visiting K/V block and its float32 gradients, each as sent and as received, and the query
  gradient's running sum beside this hop's share."""
  return d.tokens * (4 * d.kv_heads * d.head_dim * (d.compute_bytes + F32_BYTES) + 2 * d.heads * d.head_dim * F32_BYTES)


def _ulysses_sent(d: Dims, shards: int) -> dict:
  """Q, K, V and the output each cross one all-to-all forward and one backward."""
  both = gather(2 * d.activation_bytes(d.heads * d.head_dim) + 2 * _kv_bytes(d), shards)
  return {("all-to-all", SEQUENCE): (both, both)}


STRATEGIES = {
    "allgather": Strategy(_allgather, _allgather_sent, calls=lambda shards: 2, held=_allgather_held),
    "ring": Strategy(_ring, _ring_sent, calls=lambda shards: shards - 1, held=_ring_held,
                     visiting=True),
    "ulysses": Strategy(_ulysses, _ulysses_sent, calls=lambda shards: 4, held=lambda d: 0),
}
