"""What every family shares: the loss and the three-part interface around the stack of blocks (model/stack.py).

A model is embed(tokens, positions) -> x, a scanned stack of identical blocks
(parameters stacked under STACKED on a leading `layers` axis), and
head_loss(x, targets) -> loss. A pipeline schedule composes the same three
parts across stages, so nothing here knows about stages, devices or meshes.
Positions are explicit so a context strategy may reorder the sequence.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from model import mtp, unet
from model.config import ModelConfig
from model.layers import soft_capped, vocab_param
from model.moe import AUX_LOSS, LOADS, MoE, summarize
from model.placement import constrain, current, placed, shard_count
from model.stack import ACTIVATION_AXES, DENSE_STACKED, STACKED, dense_layers_config, scan_blocks, stacked
from model.value_embeds import VALUE_EMBEDS


def embedding_rows(table_VD, tokens_BT, cfg: ModelConfig):
  """The table's rows for each token.

  Under hybrid sharding (cfg.gathered_lookup) from a copy of the table with its `embed` axis gathered,
  as ZeRO-3 gathers any weight before use: with it left sharded over the ZeRO groups, XLA's gather
  partitioner aborts the process on some meshes (data=3 x expert=2: "Could not slice dimension 0 with
  size 3"). It costs the table's gradient an all-reduce over the group where a reduce-scatter would
  do, which is why plain ZeRO-3 keeps the sharded lookup.
  """
  if cfg.gathered_lookup:
    table_VD = constrain(table_VD, ("vocab",) + (None,) * (table_VD.ndim - 1))
  return _rows_in(table_VD, tokens_BT, cfg.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rows_in(table_VD, tokens_BT, dtype):
  """table_VD[tokens_BT] in `dtype`, its gradient accumulated in the table's own dtype.

  The rows are looked up from the table cast first: with the vocabulary split over `tensor`, each
  device gathers the rows it holds and an all-reduce over `tensor` assembles them, which then moves
  bfloat16, not float32 (Megatron's embedding all-reduce is bfloat16 too). Each row's rounding is
  the same either way. Autodiff would transpose the cast into a bfloat16 scatter-add, which rounds a
  frequent token's sum over the batch; the backward pass below adds the cotangents in float32.
  """
  return table_VD.astype(dtype)[tokens_BT]


def _rows_in_forward(table_VD, tokens_BT, dtype):
  return _rows_in(table_VD, tokens_BT, dtype), (table_VD, tokens_BT)


def _rows_in_backward(dtype, saved, d_rows_BTD):
  table_VD, tokens_BT = saved
  return jnp.zeros_like(table_VD).at[tokens_BT].add(d_rows_BTD.astype(table_VD.dtype)), None


_rows_in.defvjp(_rows_in_forward, _rows_in_backward)


def masked_vocab(logits_BTV, cfg: ModelConfig):
  """Float32 logits in which the vocabulary's padding can never be predicted.

  The loss reads the head's output as the matmul left it instead (`LanguageModel.head_output`).
  """
  real_V = jnp.arange(cfg.padded_vocab) < cfg.vocab_size
  scored_BTV = soft_capped(logits_BTV.astype(jnp.float32) * cfg.output_multiplier, cfg.logit_softcap)
  return jnp.where(real_V, scored_BTV, jnp.finfo(jnp.float32).min)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def token_losses(logits_BTV, targets_BT, vocab_size=None, multiplier=1.0):
  """Each position's next-token cross-entropy in float32: log-sum-exp minus the target's logit.

  The logits may be the head's output in the compute dtype, the vocabulary's padding (entries from
  `vocab_size` on) unmasked and not yet multiplied by `multiplier`: both are applied where the values are
  read, and float32 exists only inside the reductions, so no float32 copy of the logits is written. The
  backward pass returns the logits' gradient in their own dtype, computed from them and the saved
  log-sum-exp in one pass.
  """
  return _token_losses_forward(logits_BTV, targets_BT, vocab_size, multiplier)[0]


def _in_vocab(logits_BTV, vocab_size):
  """Which entries of the last axis are tokens (those before `vocab_size`), not the vocabulary's padding."""
  entries = logits_BTV.shape[-1]
  return jnp.arange(entries) < (entries if vocab_size is None else vocab_size)


def _is_target(logits_BTV, targets_BT):
  # Compare-and-select rather than a gather: with `vocab` sharded it is a local
  # select and one reduction, which every partitioner handles.
  return jnp.arange(logits_BTV.shape[-1]) == targets_BT[..., None]


def _token_losses_forward(logits_BTV, targets_BT, vocab_size, multiplier):
  # The padding is masked in the logits' own dtype: a select in float32 would be a float32 array, which
  # not every backend's reductions absorb (XLA's CPU backend does not). The maximum and the target's
  # logit are picked, not summed, so they are exact in that dtype; the multiplier is positive, so it
  # commutes with the maximum.
  real_BTV = jnp.where(_in_vocab(logits_BTV, vocab_size), logits_BTV, -jnp.inf)
  max_BT = real_BTV.max(-1).astype(jnp.float32) * multiplier
  sum_BT = jnp.exp(real_BTV.astype(jnp.float32) * multiplier - max_BT[..., None]).sum(-1)
  target_BT = jnp.where(_is_target(logits_BTV, targets_BT), logits_BTV, 0).sum(-1, dtype=jnp.float32) * multiplier
  lse_BT = max_BT + jnp.log(sum_BT)
  return lse_BT - target_BT, (logits_BTV, targets_BT, lse_BT)


def _token_losses_backward(vocab_size, multiplier, saved, g_BT):
  logits_BTV, targets_BT, lse_BT = saved
  # Masked after the exponential here: one cast shared with the forward pass would be a float32 array
  # with two readers, written out for both.
  softmax_BTV = jnp.exp(logits_BTV.astype(jnp.float32) * multiplier - lse_BT[..., None])
  softmax_BTV = jnp.where(_in_vocab(logits_BTV, vocab_size), softmax_BTV, 0.0)
  d_BTV = (softmax_BTV - _is_target(logits_BTV, targets_BT)) * (g_BT * multiplier)[..., None]
  return d_BTV.astype(logits_BTV.dtype), None


token_losses.defvjp(_token_losses_forward, _token_losses_backward)


def chunk_positions(tokens: int, rows_per_device: int, sequence_shards: int) -> int:
  """Positions per chunk that give each device about `tokens` tokens per chunk (model.loss_chunk, mlp_chunk).

  Sized per device because memory is per device: a chunk's logits are its
  tokens on each device times the local vocabulary.
  """
  return max(1, tokens * sequence_shards // max(1, rows_per_device))


def chunk_count(length: int, chunk: int) -> int:
  """Chunks of at most `chunk` positions that divide `length` evenly."""
  return next(c for c in range(-(-length // chunk), length + 1) if length % c == 0)


def strided_chunks(x_BTX, chunks: int):
  """(batch, length, ...) as (chunks, batch, length / chunks, ...), chunk c holding positions c, c+C, c+2C, ...

  Strided, so a `length` sharded over `sequence` stays sharded within every chunk.
  """
  b, t = x_BTX.shape[:2]
  return jnp.moveaxis(x_BTX.reshape(b, t // chunks, chunks, *x_BTX.shape[2:]), 2, 0)


def unchunk(x_CBtX):
  """strided_chunks undone."""
  return jnp.moveaxis(x_CBtX, 0, 2).reshape(x_CBtX.shape[1], -1, *x_CBtX.shape[3:])


def feed_forward(layer, norm, x_BTD, positions_T):
  """A block's normalised feed-forward layer, dense or MoE, as (output, router statistics).

  A dense layer with model.mlp_chunk set runs on one chunk of positions at a time,
  each chunk recomputed in the backward pass: the norm's float32 values and the
  MLP's hidden ones then exist for one chunk, not the whole sequence, at the
  price of one more forward pass of the MLP. MoE routes the whole sequence at once.
  """
  if isinstance(layer, MoE):
    return layer(norm(x_BTD), positions_T)
  chunks = chunk_count(x_BTD.shape[1], layer.cfg.mlp_chunk) if layer.cfg.mlp_chunk else 1
  if chunks == 1:
    return layer(norm(x_BTD)), {}
  y_CBtD = jax.lax.map(jax.checkpoint(lambda x_BtD: layer(norm(x_BtD))), strided_chunks(x_BTD, chunks))
  return constrain(unchunk(y_CBtD), ACTIVATION_AXES), {}


def head_token_losses(model, x_BtD, targets_Bt, normalized=False, temperature=1.0):
  """Each position's cross-entropy of the head's prediction for `x_BtD` (after the final norm, unless `normalized`),
  the logits divided by `temperature` (as a sampler at that temperature draws from them)."""
  logits_BtV = model.head_logits(x_BtD) if normalized else model.head_output(x_BtD)
  multiplier = model.cfg.output_multiplier
  if model.cfg.logit_softcap:  # capped as the softmax sees them (after muP's multiplier), in float32
    logits_BtV, multiplier = soft_capped(logits_BtV.astype(jnp.float32) * multiplier, model.cfg.logit_softcap), 1.0
  return token_losses(logits_BtV, targets_Bt, model.cfg.vocab_size, multiplier / temperature)


def token_log_probs(model, x_BTD, targets_BT, temperature=1.0):
  """Each position's log-probability of its target, float32 [B, T], the logits over `temperature`.

  What preference and reinforcement objectives take (training/preference.py, training/grpo.py): nonlinear
  functions of these, so the chunked loss's trick of taking the head's gradient in the forward pass (which needs one
  scalar) does not apply. The head runs on one chunk of positions at a time, recomputed in the backward pass: the
  logits still exist for one chunk only.
  """
  chunks = chunk_count(x_BTD.shape[1], model.cfg.loss_chunk)
  chunk_log_probs = jax.checkpoint(lambda x_BtD, targets_Bt: -head_token_losses(model, x_BtD, targets_Bt,
                                                                                 temperature=temperature))
  to_chunks = lambda x: strided_chunks(x, chunks)
  return unchunk(jax.lax.map(lambda chunk: chunk_log_probs(*chunk), (to_chunks(x_BTD), to_chunks(targets_BT))))


def chunked_cross_entropy(model, x_BTD, targets_BT, weights_BT=None, normalized=False):
  """Mean next-token cross-entropy, the head and loss run on one chunk of positions at a time.

  With `weights_BT`, each position's loss is weighted first (fine-tuning on completions scores the
  answer's tokens only): the mean of weight x loss, so weights that average 1 over the batch
  (training/step.py `normalized_weights`) give the mean over the weighted tokens. `normalized`: `x_BTD` has
  been normalised already (a multi-token prediction module's own output norm, model/mtp.py), so the head
  skips the model's final norm.

  The logits exist for one chunk at a time (B x T/C x V, not B x T x V), chunks
  by strided_chunks, and in the compute dtype: token_losses reads them in float32
  only inside its reductions and writes their gradient in the compute dtype. Each
  chunk's gradient is taken in the forward pass (a custom VJP) and the backward
  pass only scales it, so the logits are neither kept nor recomputed.
  """
  b, t, d = x_BTD.shape
  chunks = chunk_count(t, model.cfg.loss_chunk)
  # What the head never reads (value tables, skip weights) goes with the stacks, for which this VJP returns nothing.
  stacks = nnx.Any(*(nnx.PathContains(name) for name in (STACKED, DENSE_STACKED, mtp.MTP, VALUE_EMBEDS, unet.UNET)))
  graphdef, stack, head = nnx.split(model, stacks, ...)
  to_chunks = lambda x: strided_chunks(x, chunks)

  def loss_sum(head, stack, x_BtD, targets_Bt, *weights_Bt):
    losses_Bt = head_token_losses(nnx.merge(graphdef, stack, head), x_BtD, targets_Bt, normalized)
    return (losses_Bt * weights_Bt[0] if weights_Bt else losses_Bt).sum()

  # The stack, targets and weights are arguments, not closed over: a custom VJP may not close over traced
  # values. `scored` is (targets,) or (targets, weights): what each position's loss is, and its weight.
  @jax.custom_vjp
  def mean_loss(head, x_BTD, stack, scored):
    losses = jax.lax.map(lambda chunk: loss_sum(head, stack, *chunk), (to_chunks(x_BTD), *map(to_chunks, scored)))
    return losses.sum() / (b * t)

  def forward(head, x_BTD, stack, scored):
    # Each device keeps its own running sum of the head's gradient, summed over the devices once at
    # the end: a replicated running sum would be all-reduced over the batch's and the sequence's
    # devices chunk by chunk. So each chunk runs as [batch shards, length shards, rows, positions]
    # (`by_shard`), the head's gradient taken per shard (vmap) and kept with both leading axes.
    # One chunk has no running sum and keeps the plain layout.
    split = {name: shards for name, shards, size in (("batch", shard_count("batch"), b),
                                                     ("length", shard_count("length"), t // chunks))
             if chunks > 1 and shards > 1 and size % shards == 0}
    rows, positions = split.get("batch", 1), split.get("length", 1)
    in_axes = (None, None, 0) + (0,) * len(scored)
    per_shard = jax.vmap(jax.vmap(jax.value_and_grad(loss_sum, argnums=(0, 2)), in_axes=in_axes), in_axes=in_axes)

    def by_shard(x_BtX, axes):
      x_BtX = constrain(x_BtX, ("batch", "length", *axes))  # as the shards lie, so the split is local
      x_RbPtX = x_BtX.reshape(rows, b // rows, positions, x_BtX.shape[1] // positions, *x_BtX.shape[2:])
      leading = tuple(name if name in split else None for name in ("batch", "length"))
      return constrain(jnp.swapaxes(x_RbPtX, 1, 2), (*leading, None, None, *axes))

    def chunk_grads(chunk):
      x_BtD, *scored_Bt = chunk
      if not split:
        loss, (d_head, d_x_BtD) = jax.value_and_grad(loss_sum, argnums=(0, 2))(head, stack, x_BtD, *scored_Bt)
        return loss[None, None], (jax.tree.map(lambda d: d[None, None], d_head), d_x_BtD)
      with placed(current().placing_outside(*split)):
        loss_RP, (d_head, d_x_RPbtD) = per_shard(head, stack, by_shard(x_BtD, ("embed",)),
                                                 *(by_shard(s_Bt, ()) for s_Bt in scored_Bt))
      return loss_RP, (d_head, jnp.swapaxes(d_x_RPbtD, 1, 2).reshape(x_BtD.shape))

    def one_chunk(carry, chunk):
      loss, (d_head, d_x_BtD) = chunk_grads(chunk)
      return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], d_head)), d_x_BtD

    chunks_cB = (to_chunks(x_BTD), *map(to_chunks, scored))
    # The first chunk starts the sums (a zero start would lose shard_map's varying axes).
    loss, (d_head, d_x_BtD) = chunk_grads(jax.tree.map(lambda x: x[0], chunks_cB))
    (total, d_head), d_x_cBtD = jax.lax.scan(one_chunk, (loss, d_head), jax.tree.map(lambda x: x[1:], chunks_cB))
    d_x_cBtD = jnp.concatenate([d_x_BtD[None], d_x_cBtD])
    return total.sum() / (b * t), (jax.tree.map(lambda d: d.sum((0, 1)), d_head), unchunk(d_x_cBtD))

  def backward(saved, g):
    d_head, d_x_BTD = saved
    scale = g / (b * t)
    return (jax.tree.map(lambda d, p: (d * scale).astype(p.dtype), d_head, head),
            (d_x_BTD * scale).astype(x_BTD.dtype), None, None)

  mean_loss.defvjp(forward, backward)
  return mean_loss(head, x_BTD, stack, (targets_BT,) if weights_BT is None else (targets_BT, weights_BT))


def document_ids(tokens_BT, document_end: int):
  """Which packed document each token belongs to: a token after `document_end` starts the next one."""
  ends_BT = (tokens_BT == document_end).astype(jnp.int32)
  return jnp.cumsum(ends_BT, axis=1) - ends_BT


def document_positions(segments_BT):
  """Each token's position within its document, [B, T]."""
  index_T = jnp.arange(segments_BT.shape[1])
  starts_BT = jnp.concatenate([jnp.ones_like(segments_BT[:, :1], bool), segments_BT[:, 1:] != segments_BT[:, :-1]], 1)
  return index_T - jax.lax.cummax(jnp.where(starts_BT, index_T, 0), axis=1)


def packed_documents(tokens_BT, positions_T, document_end: int):
  """(segment ids [B, T], the positions the embedding sees) for tokens in the order `positions_T` gives:
  with packing (document_end >= 0) each token's document and its position within it, found in token
  order whatever order the sequence arrives in; without, (None, positions_T)."""
  if document_end < 0:
    return None, positions_T
  segments_BT = document_ids(tokens_BT[:, jnp.argsort(positions_T)], document_end)
  return segments_BT[:, positions_T], document_positions(segments_BT)[:, positions_T]


class LanguageModel(nnx.Module):
  """The stack and the loss every family shares.

  A family adds `embed_tokens(tokens_BT, positions_T) -> x_BTD`, `final_norm(x_BTD)` and
  `head_logits(x_BTD) -> logits_BTV` (the head's matmul, in the compute dtype, the vocabulary's padding not yet
  masked), and keeps its stacked blocks in `self.blocks` (stack_blocks).
  """

  def stack_blocks(self, block_class, rngs: nnx.Rngs):
    """The scanned stack `self.blocks`; before it, with moe.first_dense, the dense layers' own stack; after it,
    with model.mtp_depth, the multi-token prediction modules (model/mtp.py); model.unet_skips' weights
    (model/unet.py)."""
    cfg = self.cfg
    if cfg.moe_first_dense:
      setattr(self, DENSE_STACKED, stacked(block_class, dense_layers_config(cfg), rngs, units=cfg.moe_first_dense))
    self.blocks = stacked(block_class, cfg, rngs)
    if cfg.mtp_depth:
      setattr(self, mtp.MTP, mtp.prediction_modules(block_class, cfg, rngs))
    if cfg.unet_skips:
      setattr(self, unet.UNET, unet.SkipWeights(cfg.num_units))

  def add_value_tables(self, rngs: nnx.Rngs):
    """model.value_embeds' tables (model/value_embeds.py), if set; model/families.py draws them after every other
    weight of the family, which then starts as it would without them."""
    cfg = self.cfg
    if cfg.value_embeds:
      shape = (cfg.value_embeds, cfg.padded_vocab, cfg.num_kv_heads, cfg.head_dim)
      setattr(self, VALUE_EMBEDS, vocab_param(rngs, shape, (None, "vocab", "kv_heads", "head_dim"), cfg.vocab_size))

  def value_rows(self, tokens_BT):
    """model.value_embeds' rows for the tokens, [tables, B, T, kv_heads, head_dim] in the compute dtype; None
    without value embeddings."""
    if not self.cfg.value_embeds:
      return None
    tables = getattr(self, VALUE_EMBEDS)[...]
    rows = jnp.stack([embedding_rows(tables[i], tokens_BT, self.cfg) for i in range(self.cfg.value_embeds)])
    return constrain(rows, (None, "batch", "length", "kv_heads", "head_dim"))

  def head_output(self, x_BTD):
    """The head's logits for the stack's output: the final norm, then the head (head_logits)."""
    return self.head_logits(self.final_norm(x_BTD))

  def logits(self, x_BTD):
    """Float32 logits, the vocabulary's padding masked."""
    return masked_vocab(self.head_output(x_BTD), self.cfg)

  def run_blocks(self, x_BTD, positions_T=None, segments_BT=None, live_L=None, units_L=None, tokens_BT=None):
    """The stack's output and its router statistics (model/moe.py `summarize`; {} when dense); `live_L`
    skips the units where it is False and `units_L` names the stacked units (scan_blocks). `tokens_BT`, the
    tokens `x_BTD` embeds, only model.value_embeds reads (and needs); with model.unet_skips the stack runs in two
    halves (model/unet.py). parallel/checks.py keeps pipelines off both, and off moe.first_dense's stack: every
    stage would run these."""
    cfg = self.cfg
    positions_T = jnp.arange(x_BTD.shape[1]) if positions_T is None else positions_T
    if cfg.value_embeds and tokens_BT is None:
      raise ValueError(f"model.value_embeds={cfg.value_embeds} mixes rows for the tokens into the values, but the "
                       "stack was run without them; pass run_blocks its tokens_BT.")
    value_rows = self.value_rows(tokens_BT)
    if cfg.moe_first_dense:
      x_BTD, _ = scan_blocks(getattr(self, DENSE_STACKED), x_BTD, positions_T, dense_layers_config(cfg), segments_BT)
    if not cfg.unet_skips:
      x_BTD, stats = scan_blocks(self.blocks, x_BTD, positions_T, cfg, segments_BT, live_L, units_L,
                                 value_rows=value_rows)
      return x_BTD, summarize(stats)
    run = lambda x_BTD, blocks, units_L, skips, keep_outputs: scan_blocks(
        blocks, x_BTD, positions_T, cfg, segments_BT, units_L=units_L, value_rows=value_rows, skips=skips,
        keep_outputs=keep_outputs)
    weights_H = getattr(self, unet.UNET).scale[...]
    x_BTD, stats = unet.in_halves(run, x_BTD, self.blocks, jnp.arange(cfg.num_units), weights_H)
    return x_BTD, summarize(stats)

  def predict(self, tokens_BT):
    """Float32 next-token logits for every position of in-order tokens."""
    return self.logits(self.run_blocks(self.embed_tokens(tokens_BT), tokens_BT=tokens_BT)[0])

  def head_loss(self, x_BTD, targets_BT, weights_BT=None, normalized=False):
    return chunked_cross_entropy(self, x_BTD, targets_BT, weights_BT, normalized)

  def objective(self, tokens_BT, targets_BT, positions_T=None, weights_BT=None):
    """(cross-entropy + auxiliary losses, statistics): what training differentiates and logs.

    With model.document_end set, the sequences are packed documents: a token
    attends within its own document, and learned positions count from its start.
    With `weights_BT`, each position's cross-entropy is weighted (chunked_cross_entropy). With
    model.mtp_depth, the prediction modules' mean cross-entropy is added at model.mtp_weight (model/mtp.py).
    """
    positions_T = jnp.arange(tokens_BT.shape[1]) if positions_T is None else positions_T
    segments_BT, embed_positions = packed_documents(tokens_BT, positions_T, self.cfg.document_end)
    x_BTD, stats = self.run_blocks(self.embed_tokens(tokens_BT, embed_positions), positions_T, segments_BT,
                                   tokens_BT=tokens_BT)
    loss = self.head_loss(x_BTD, targets_BT, weights_BT)
    objective, stats = loss + stats.get(AUX_LOSS, 0.0), {"cross_entropy": loss, **stats}
    if self.cfg.mtp_depth:
      ahead, routed = mtp.prediction_loss(self, x_BTD, targets_BT, positions_T, segments_BT, embed_positions,
                                          weights_BT)
      # The modules' router statistics join only as their balance losses and their loads (for their own bias).
      objective += self.cfg.mtp_weight * ahead + routed.get(AUX_LOSS, 0.0)
      stats = {**stats, mtp.LOSS: ahead, **({mtp.LOADS: routed[LOADS]} if LOADS in routed else {})}
    return objective, stats

  def sequence_log_probs(self, tokens_BT, targets_BT, mask_BT, positions_T=None):
    """(each row's log-probability of its targets where `mask_BT` is 1, float32 [B]; router statistics)."""
    log_probs_BT, stats = self.token_log_probs(tokens_BT, targets_BT, positions_T)
    return (log_probs_BT * mask_BT).sum(-1), stats

  def token_log_probs(self, tokens_BT, targets_BT, positions_T=None, temperature=1.0):
    """(each position's log-probability of its target, float32 [B, T], the logits over `temperature`; router
    statistics). Each row is one sequence: no packed documents."""
    positions_T = jnp.arange(tokens_BT.shape[1]) if positions_T is None else positions_T
    x_BTD, stats = self.run_blocks(self.embed_tokens(tokens_BT, positions_T), positions_T, tokens_BT=tokens_BT)
    return token_log_probs(self, x_BTD, targets_BT, temperature), stats

  def __call__(self, tokens_BT, targets_BT, positions_T=None):
    """The next-token cross-entropy (what evaluation reports)."""
    return self.objective(tokens_BT, targets_BT, positions_T)[1]["cross_entropy"]
