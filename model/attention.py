"""Causal self-attention: the kernels, the one call the model makes, and GPT-2's attention layer."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from model.config import ModelConfig
from model.layers import RMSNorm, matmul, out_projection_std, param, soft_capped, zeros
from model.placement import constrain, current
from model.value_embeds import ValueMix, mixed_values


ATTENTION_OUT = "attention_out"  # the name remat policies save or offload (model/transformer.py)
CUDNN_DTYPES = ("bfloat16", "float16")  # cuDNN's fused attention runs in half precision only
CUDNN_MAX_HEAD = 128
SPLASH_BLOCK = 128  # TPU splash attention tiles queries and keys in multiples of 128 positions


def kernel(cfg: ModelConfig, backend: str) -> str:
  """The kernel model.attention runs on `backend` (jax.default_backend()) for an unsharded, unpacked sequence.

  auto takes cuDNN's fused flash attention on a GPU where it applies (half
  precision, head width a multiple of 8 up to 128), splash attention on a TPU
  (a sequence of whole 128-position tiles), and the blockwise xla kernel
  everywhere else: CPUs, float32 or float8 GPU runs, odd lengths.
  """
  if cfg.attention != "auto":
    return cfg.attention
  head = cfg.head_dim
  if (backend == "gpu" and cfg.compute_dtype in CUDNN_DTYPES and head % 8 == 0 and head <= CUDNN_MAX_HEAD
      and not cfg.attention_softcap):  # JAX's cuDNN attention takes no soft-cap
    return "cudnn"
  if backend == "tpu" and cfg.max_len % SPLASH_BLOCK == 0:
    return "splash"
  return "xla"


def splash_attention(q_BTNH, k_BTKH, v_BTKH, segments_BT=None, *, window: int = 0, softcap: float = 0.0) -> jax.Array:
  """Causal attention by the splash kernel (Pallas), for queries and keys that are one contiguous run.

  A Mosaic kernel is not partitioned automatically: the placement runs this
  per device (`Placement.per_device`) on its rows and heads. Off a TPU the kernel
  runs in Pallas' interpreter, which is how the CPU tests check its numbers.
  With `segments_BT` (packed documents) the kernel's own segment ids keep each
  query within its document. With a `window` W > 0, its local mask keeps the
  W - 1 keys before each query and the query's own; a `softcap` C > 0 is the kernel's own logit soft-cap.
  """
  t, heads, head_dim = q_BTNH.shape[1:]
  block = max((b for b in range(SPLASH_BLOCK, 4 * SPLASH_BLOCK + 1, SPLASH_BLOCK) if t % b == 0), default=t)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  one = splash_mask.LocalMask((t, t), (window - 1, 0), offset=0) if window else splash_mask.CausalMask((t, t))
  mask = splash_mask.MultiHeadMask([one for _ in range(heads)])
  mha = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                               attn_logits_soft_cap=softcap or None, interpret=jax.default_backend() != "tpu")
  group = heads // k_BTKH.shape[2]  # grouped-query: each key/value head serves `group` query heads
  heads_first = lambda x_BTXH: jnp.swapaxes(x_BTXH, 1, 2)
  q_BNTH = heads_first(q_BTNH * head_dim ** -0.5)
  k_BNTH, v_BNTH = (heads_first(jnp.repeat(x, group, axis=2)) for x in (k_BTKH, v_BTKH))
  if segments_BT is None:
    return heads_first(jax.vmap(mha)(q_BNTH, k_BNTH, v_BNTH))
  packed = lambda q, k, v, segments_T: mha(q, k, v, segment_ids=splash.SegmentIds(q=segments_T, kv=segments_T))
  return heads_first(jax.vmap(packed)(q_BNTH, k_BNTH, v_BNTH, segments_BT))


def attention(q_BTNH, k_BSKH, v_BSKH, positions_T, cfg: ModelConfig, segments_BT=None, cache=None,
              global_layer=None) -> jax.Array:
  """Causal attention by token position, with K <= N key/value heads (grouped-query).

  Positions, not array order, decide what each query may see: the placement's
  attention strategy may reorder the sequence (zig-zag ring attention) and
  shard it. With `segments_BT` (packed documents, model.document_end) a query
  sees only keys of its own segment. With `cache` (decoding, model/kv_cache.py
  LayerCache) the new keys and values are written into the layer's cache and
  the queries attend over all of it. With `cfg.sliding_window` = W > 0 a query
  sees only the W latest positions up to its own (Mistral's sliding window); with model.global_every, only in
  the layers where `global_layer` is False (`per_layer_window`). With
  `cfg.attention_softcap` = C > 0 each scaled score s enters the softmax as C tanh(s / C). With
  `cfg.attention_scale_width` = S > 0 scores are scaled by 1 / sqrt(S) rather than by the head width's.
  """
  placement, softcap = current(), cfg.attention_softcap
  if cfg.attention_scale_width:  # scores over sqrt(this), not the head width, by which every kernel divides
    q_BTNH = q_BTNH * jnp.asarray((q_BTNH.shape[-1] / cfg.attention_scale_width) ** 0.5, q_BTNH.dtype)
  if cache is not None:
    return cache.attend(q_BTNH, k_BSKH, v_BSKH, positions_T, cfg.attention_block, cfg.sliding_window, softcap,
                        global_layer)

  def attend(window):
    if placement.attention is not None:
      return placement.attention(q_BTNH, k_BSKH, v_BSKH, positions_T, segments_BT, block=cfg.attention_block,
                                 window=window, softcap=softcap)
    if (chosen := kernel(cfg, jax.default_backend())) == "cudnn":  # parallel/checks.py keeps packing off it
      # cuDNN's causal mask is by index: right when queries and keys are the same contiguous run; so is its
      # window, (W - 1) keys before each query and none after.
      return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True, implementation="cudnn",
                                          local_window_size=(window - 1, 0) if window else None)
    if chosen == "splash":  # causal by index too
      segments = () if segments_BT is None else (segments_BT,)
      return placement.per_device(functools.partial(splash_attention, window=window, softcap=softcap), q_BTNH,
                                  k_BSKH, v_BSKH, *segments)
    segments = None if segments_BT is None else (segments_BT, segments_BT)
    return blockwise_attention(q_BTNH, k_BSKH, v_BSKH, positions_T, positions_T, cfg.attention_block,
                               segments, window, softcap)[0]

  return checkpoint_name(per_layer_window(attend, cfg.sliding_window, global_layer), ATTENTION_OUT)


def per_layer_window(attend, window: int, global_layer=None):
  """attend(window), or where the traced flag `global_layer` is given, attend over the whole causal context
  (attend(0)) in the layers where it is True and within `window` in the others.

  Each branch of the lax.cond has a static window, so every kernel keeps its own masks and skipped blocks,
  and a stack whose global layers do not fall into equal groups (Gemma 3 1B: every sixth of 26) still scans
  one kind of block.
  """
  if global_layer is None:
    return attend(window)
  return jax.lax.cond(global_layer, lambda: attend(0), lambda: attend(window))


def blockwise_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, block: int, segments=None,
                        window: int = 0, softcap: float = 0.0):
  """Attention in query and key blocks of at most `block` positions: (out, log-sum-exp of each row's scores).

  `segments`, if given, is (query segments [B, T], key segments [B, S]): a
  query sees a key only of its own segment. `window` W > 0: a query sees only
  keys fewer than W positions before its own, and a key block wholly outside
  every query's window (or wholly after it) is skipped by a branch, not scored
  under a mask. `softcap` C > 0 bounds each scaled score s to C tanh(s / C) before the softmax (Gemma 2's
  soft-capping; forward and backward).

  A sequence no longer than `block` is one block (attention_block, differentiated
  by autodiff). A longer one runs flash attention's algorithm in plain JAX: an
  online softmax over key blocks forward, and a backward pass that recomputes
  each block's probabilities from the saved log-sum-exp, so no T x S scores
  exist at once and memory grows linearly with the sequence. Blocks are the
  largest divisors of T and S no longer than `block`.
  """
  t, s = q_BTNH.shape[1], k_BSKH.shape[1]
  blocks = (largest_divisor(t, block), largest_divisor(s, block))
  if blocks == (t, s):
    scored = lambda: attention_block(q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, segments, window, softcap)
    if not window:
      return scored()
    return jax.lax.cond(_in_window(q_positions_T, k_positions_S, window), scored,
                        lambda: _nothing_seen(q_BTNH, k_BSKH.shape[2], v_BSKH.dtype))
  return _flash(blocks, window, softcap, q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, segments)


def largest_divisor(length: int, most: int) -> int:
  """The longest block no longer than `most` that divides `length` evenly."""
  return max(d for d in range(1, min(length, most) + 1) if length % d == 0)


def _split(x, size: int):
  """(batch, length, ...) as (length / size blocks, batch, size, ...)."""
  return jnp.moveaxis(x.reshape(x.shape[0], -1, size, *x.shape[2:]), 1, 0)


def _unsplit(x):
  return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _split_segments(segments, blocks):
  """Query and key segments split into blocks like the queries and keys (None stays None)."""
  return (None, None) if segments is None else tuple(_split(x, size) for x, size in zip(segments, blocks))


def _segment_pair(q_segments, k_segments):
  """One block pair's (query, key) segments, or None without packing."""
  return None if q_segments is None else (q_segments, k_segments)


def _nothing_seen(q_BTNH, kv_heads: int, dtype):
  """(out, log-sum-exp) of rows that see no key: out 0 and the lowest log-sum-exp, which weighs nothing in a
  merge; derived from the queries, so that shard_map's varying axes stay."""
  b, t, n, _ = q_BTNH.shape
  lse_BKGT = jnp.moveaxis(q_BTNH[..., 0].reshape(b, t, kv_heads, n // kv_heads), 1, -1).astype(jnp.float32)
  return (q_BTNH * 0).astype(dtype), lse_BKGT * 0 + jnp.finfo(jnp.float32).min


def _in_window(q_positions_T, k_positions_S, window: int):
  """Whether any query of a block sees any key of another within a window W > 0: a key no later than the
  last query and fewer than W positions before the first."""
  return (k_positions_S.min() <= q_positions_T.max()) & (q_positions_T.min() - k_positions_S.max() < window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(blocks, window, softcap, q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, segments):
  return _flash_forward(blocks, window, softcap, q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, segments)[0]


def _flash_forward(blocks, window, softcap, q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, segments):
  q_block, k_block = blocks
  q_segments, k_segments = _split_segments(segments, blocks)
  key_blocks = (_split(k_BSKH, k_block), _split(v_BSKH, k_block), k_positions_S.reshape(-1, k_block), k_segments)

  def one_query_block(query):
    q_bTNH, q_positions_bT, q_segments_Bb = query
    score = lambda key: attention_block(q_bTNH, key[0], key[1], q_positions_bT, key[2],
                                        _segment_pair(q_segments_Bb, key[3]), window, softcap)

    def visit(merged, key):
      if not window:
        return merge_blocks(merged, score(key)), None
      return jax.lax.cond(_in_window(q_positions_bT, key[2], window), lambda: merge_blocks(merged, score(key)),
                          lambda: merged), None

    if window:  # any key block may lie outside the window: start from rows that have seen nothing
      start, keys = _nothing_seen(q_bTNH, key_blocks[0].shape[3], jnp.float32), key_blocks
    else:  # the first key block starts the running result (a zero start would lose shard_map's varying axes)
      first = score(jax.tree.map(lambda x: x[0], key_blocks))
      start, keys = (first[0].astype(jnp.float32), first[1]), jax.tree.map(lambda x: x[1:], key_blocks)
    merged, _ = jax.lax.scan(visit, start, keys)
    return merged

  out_qBTNH, lse_qBKGT = jax.lax.map(
      one_query_block, (_split(q_BTNH, q_block), q_positions_T.reshape(-1, q_block), q_segments))
  out_BTNH = _unsplit(out_qBTNH).astype(q_BTNH.dtype)
  lse_BKGT = jnp.moveaxis(lse_qBKGT, 0, -2).reshape(*lse_qBKGT.shape[1:-1], -1)
  return (out_BTNH, lse_BKGT), (q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, segments, out_BTNH, lse_BKGT)


def _flash_backward(blocks, window, softcap, saved, cotangents):
  q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, segments, out_BTNH, lse_BKGT = saved
  d_q_BTNH, d_k_BSKH, d_v_BSKH = _block_gradients(
      blocks, (q_BTNH, q_positions_T, out_BTNH, lse_BKGT, *cotangents), (k_BSKH, v_BSKH, k_positions_S), segments,
      window, softcap)
  return (d_q_BTNH.astype(q_BTNH.dtype), d_k_BSKH.astype(k_BSKH.dtype), d_v_BSKH.astype(v_BSKH.dtype), None, None,
          None)


def flash_gradients(block: int, rows, keys, segments=None, window: int = 0, softcap: float = 0.0):
  """Float32 (dQ, dK, dV) of queries against some of the keys they attend to, in blocks of at most `block`.

  `rows` = (q, q positions, out, log-sum-exp, dOut, dLse): the queries, their whole attention's
  output and log-sum-exp (over every key, not only these) and those outputs' cotangents;
  `keys` = (k, v, k positions); `segments`, `window` and `softcap` as blockwise_attention's. Ring attention sums
  these over the blocks of keys it visits.
  """
  blocks = (largest_divisor(rows[0].shape[1], block), largest_divisor(keys[0].shape[1], block))
  return _block_gradients(blocks, rows, keys, segments, window, softcap)


def _block_gradients(blocks, rows, keys, segments=None, window: int = 0, softcap: float = 0.0):
  """Flash attention's backward: per block, p = exp(s - lse), then dV, dP, dS = p (dP - D) and dQ, dK.

  D = rowsum(dOut * out) - dLse: the log-sum-exp's own cotangent enters every score as dLse * p. A
  soft-capped score s = C tanh(r / C) passes dS on to its raw score r times 1 - (s / C)^2.
  """
  q_BTNH, q_positions_T, out_BTNH, lse_BKGT, d_out_BTNH, d_lse_BKGT = rows
  k_BSKH, v_BSKH, k_positions_S = keys
  q_block, k_block = blocks
  b, t, n, h = q_BTNH.shape
  kv_heads, scale = k_BSKH.shape[2], h ** -0.5
  grouped = lambda x_BTNH: x_BTNH.reshape(*x_BTNH.shape[:2], kv_heads, n // kv_heads, h)
  f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  rowsum_BKGT = jnp.einsum("btkgh,btkgh->bkgt", grouped(d_out_BTNH).astype(jnp.float32),
                           grouped(out_BTNH).astype(jnp.float32)) - d_lse_BKGT
  stats_BKGT = jnp.stack([lse_BKGT, rowsum_BKGT])  # (2, B, K, G, T): split by query block below
  q_segments, k_segments = _split_segments(segments, blocks)
  key_blocks = (_split(k_BSKH, k_block), _split(v_BSKH, k_block), k_positions_S.reshape(-1, k_block), k_segments)

  def one_query_block(d_kv, query):
    q_bTNH, d_out_bTNH, q_positions_bT, stats_2BKGb, q_segments_Bb = query
    q_bTKGH, d_out_bTKGH = grouped(q_bTNH), grouped(d_out_bTNH)

    def visit(d_q_bTKGH, key):
      if not window:
        return score(d_q_bTKGH, key)
      zeros = lambda: (d_q_bTKGH, (key[0].astype(jnp.float32) * 0, key[1].astype(jnp.float32) * 0))
      return jax.lax.cond(_in_window(q_positions_bT, key[2], window), lambda: score(d_q_bTKGH, key), zeros)

    def score(d_q_bTKGH, key):
      k_bSKH, v_bSKH, k_positions_bS, k_segments_BS = key
      logits_BKGbS = soft_capped(f32("btkgh,bskh->bkgts", q_bTKGH, k_bSKH) * scale, softcap)
      visible_bS = _visible(logits_BKGbS, q_positions_bT, k_positions_bS, _segment_pair(q_segments_Bb, k_segments_BS),
                            window)
      probs_BKGbS = jnp.where(visible_bS, jnp.exp(logits_BKGbS - stats_2BKGb[0][..., None]), 0.0)
      d_v_bSKH = f32("bkgts,btkgh->bskh", probs_BKGbS.astype(v_bSKH.dtype), d_out_bTKGH)
      d_probs_BKGbS = f32("btkgh,bskh->bkgts", d_out_bTKGH, v_bSKH)
      d_logits_BKGbS = probs_BKGbS * (d_probs_BKGbS - stats_2BKGb[1][..., None]) * scale
      if softcap:
        d_logits_BKGbS = d_logits_BKGbS * (1 - jnp.square(logits_BKGbS / softcap))
      d_logits_BKGbS = d_logits_BKGbS.astype(q_bTNH.dtype)
      d_q_bTKGH = d_q_bTKGH + f32("bkgts,bskh->btkgh", d_logits_BKGbS, k_bSKH)
      d_k_bSKH = f32("bkgts,btkgh->bskh", d_logits_BKGbS, q_bTKGH)
      return d_q_bTKGH, (d_k_bSKH, d_v_bSKH)

    # Zero starts derived from the inputs keep shard_map's varying axes.
    d_q_bTKGH, (d_k_kBSKH, d_v_kBSKH) = jax.lax.scan(visit, q_bTKGH.astype(jnp.float32) * 0, key_blocks)
    d_k_BSKH, d_v_BSKH = d_kv
    return (d_k_BSKH + _unsplit(d_k_kBSKH), d_v_BSKH + _unsplit(d_v_kBSKH)), d_q_bTKGH.reshape(q_bTNH.shape)

  stats_q2BKGb = jnp.moveaxis(stats_BKGT.reshape(*stats_BKGT.shape[:-1], -1, q_block), -2, 0)
  d_kv_init = (k_BSKH.astype(jnp.float32) * 0, v_BSKH.astype(jnp.float32) * 0)
  (d_k_BSKH, d_v_BSKH), d_q_qBTNH = jax.lax.scan(
      one_query_block, d_kv_init,
      (_split(q_BTNH, q_block), _split(d_out_BTNH, q_block), q_positions_T.reshape(-1, q_block), stats_q2BKGb,
       q_segments))
  return _unsplit(d_q_qBTNH), d_k_BSKH, d_v_BSKH


_flash.defvjp(_flash_forward, _flash_backward)


def merge_blocks(a, b):
  """Online softmax: two blocks' (out, log-sum-exp) over disjoint keys as one, out in float32.

  Each partial output is weighted by its share of the merged row's exponentials.
  """
  (a_out_BTNH, a_lse_BKGT), (b_out_BTNH, b_lse_BKGT) = a, b
  batch, t, n, _ = a_out_BTNH.shape
  lse_BKGT = jnp.logaddexp(a_lse_BKGT, b_lse_BKGT)
  as_heads = lambda w_BKGT: jnp.moveaxis(w_BKGT, -1, 1).reshape(batch, t, n)[..., None]
  out_BTNH = (a_out_BTNH.astype(jnp.float32) * as_heads(jnp.exp(a_lse_BKGT - lse_BKGT))
              + b_out_BTNH.astype(jnp.float32) * as_heads(jnp.exp(b_lse_BKGT - lse_BKGT)))
  return out_BTNH, lse_BKGT


def _visible(logits_BKGTS, q_positions_T, k_positions_S, segments=None, window: int = 0):
  """The causal mask of one block: which keys each query sees, by token position ([T, S]), within a `window`
  W > 0 only the keys fewer than W positions before it, and with `segments` (query [B, T], key [B, S]) only
  within its own segment ([B, 1, 1, T, S]).

  Computed after the block's logits (an optimization barrier ties the two):
  the mask depends on positions alone, and XLA would otherwise hoist it out of
  the loops over blocks and keep every block pair's mask at once, T x S in all.
  """
  _, q_positions_T, k_positions_S, segments = jax.lax.optimization_barrier(
      (logits_BKGTS, q_positions_T, k_positions_S, segments))
  causal_TS = k_positions_S[None, :] <= q_positions_T[:, None]
  if window:
    causal_TS &= q_positions_T[:, None] - k_positions_S[None, :] < window
  if segments is None:
    return causal_TS
  same_BTS = segments[0][:, :, None] == segments[1][:, None, :]
  return (causal_TS & same_BTS)[:, None, None]


def attention_block(q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, segments=None, window: int = 0,
                    softcap: float = 0.0):
  """Normalised attention of one query block over one key block: (out, log-sum-exp of each row's scores).

  The log-sum-exp lets blocks over other keys merge in (merge_blocks). A row
  that sees no key has out 0 and a log-sum-exp near float32's lowest value, so it
  weighs nothing in a merge. Everything after the QK product is float32.
  """
  b, t, n, h = q_BTNH.shape
  kv_heads = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, kv_heads, n // kv_heads, h)
  logits_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  logits_BKGTS = soft_capped(logits_BKGTS * (h ** -0.5), softcap)
  visible_TS = _visible(logits_BKGTS, q_positions_T, k_positions_S, segments, window)
  logits_BKGTS = jnp.where(visible_TS, logits_BKGTS, jnp.finfo(jnp.float32).min)
  max_BKGT = logits_BKGTS.max(-1)
  exp_BKGTS = jnp.where(visible_TS, jnp.exp(logits_BKGTS - max_BKGT[..., None]), 0.0)
  sum_BKGT = jnp.maximum(exp_BKGTS.sum(-1), 1e-30)
  probs_BKGTS = (exp_BKGTS / sum_BKGT[..., None]).astype(v_BSKH.dtype)
  out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(b, t, n, h), max_BKGT + jnp.log(sum_BKGT)


class SelfAttention(nnx.Module):
  """GPT-2 attention: fused QKV projection (column parallel), output projection (row parallel)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, h = cfg.embed_dim, cfg.num_heads, cfg.head_dim
    self.qkv_kernel = param(rngs, (d, 3, n, h), ("embed", None, "heads", "head_dim"))
    self.qkv_bias = zeros((3, n, h), (None, "heads", "head_dim"))
    self.out_kernel = param(rngs, (n, h, d), ("heads", "head_dim", "embed"),
                            std=out_projection_std(cfg))
    self.out_bias = zeros((d,), ("embed",))
    if cfg.value_embeds:
      self.value_mix = ValueMix()
    if cfg.qk_norm:
      self.q_norm, self.k_norm = (RMSNorm(h, cfg.epsilon, axis="head_dim") for _ in range(2))
    self.cfg = cfg

  def __call__(self, x_BTD: jax.Array, positions_T: jax.Array, segments_BT=None, cache=None,
               global_layer=None, value_embed=None) -> jax.Array:
    dtype = self.cfg.dtype
    qkv_BT3NH = matmul("btd,dcnh->btcnh", x_BTD, self.qkv_kernel[...], dtype, self.cfg.fp8)
    qkv_BT3NH = qkv_BT3NH + self.qkv_bias[...].astype(dtype)
    q_BTNH, k_BTNH, v_BTNH = (
        constrain(qkv_BT3NH[:, :, i], ("batch", "length", "heads", "head_dim")) for i in range(3))
    v_BTNH = mixed_values(self, v_BTNH, value_embed)
    if self.cfg.qk_norm:
      q_BTNH, k_BTNH = self.q_norm(q_BTNH), self.k_norm(k_BTNH)
    out_BTNH = attention(q_BTNH, k_BTNH, v_BTNH, positions_T, self.cfg, segments_BT, cache, global_layer)
    out_BTD = matmul("btnh,nhd->btd", out_BTNH, self.out_kernel[...], dtype, self.cfg.fp8)
    return out_BTD + self.out_bias[...].astype(dtype)
