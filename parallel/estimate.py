"""What a train step should cost per device, by arithmetic: memory and collective bytes.

Nothing is compiled or allocated. The weights come in as (shape, logical axes)
pairs, read off the model's abstract (nnx.eval_shape), so the estimate cannot
drift from the model; their per-device size follows the same rules table
(parallel/rules.py) the run shards with. Everything else is the textbook
arithmetic of the seeds (MLSysBook ch. 18, the distributed-training chapter):

- memory: fp32 params, gradients and Adam's m and v (GPT-2 1.5B: about 6 GB
  each on one device), the batch, and the activations saved for the backward
  pass under the remat policy.
- collectives, as bytes one device sends per step under the ring algorithms
  (all-reduce 2N(D-1)/D, all-gather and reduce-scatter N(D-1)/D with N the
  full buffer, all-to-all N(D-1)/D, collective-permute N), for what the layout
  does: data-parallel gradient all-reduce, ZeRO/FSDP all-gathers and
  reduce-scatters, Megatron's two all-reduces per layer each way, pipeline
  hand-offs per micro-batch, and the context strategies over `sequence`.

Keys of the collective estimate are (kind, axes joined by "+"), as
parallel/analysis.py `traffic_per_step` reads them off compiled HLO.
"""

import collections
import dataclasses
import math

import numpy as np

from model import moe
from model.attention import largest_divisor
from model.config import FAMILIES, VOCAB_MULTIPLE
from model.transformer import chunk_count, chunk_positions
from parallel import rules, schedules
from parallel.mesh import AXES, DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR

ADAM_MOMENTS = {"adamw": 2, "adam": 2, "adam_l2": 2, "momentum": 1, "sgd": 0}
INT32_BYTES = 4
MASTER_BYTES = 4  # master weights and their gradients are float32 whatever the compute dtype


@dataclasses.dataclass(frozen=True)
class Weight:
  shape: tuple[int, ...]
  axes: tuple  # logical names, None where unnamed

  @property
  def stacked(self) -> bool:
    return "layers" in self.axes


@dataclasses.dataclass(frozen=True)
class Dims:
  """The per-device sizes a step works on: tokens of one micro-batch, heads and widths per shard."""
  mesh: dict
  batch: int  # sequences per device in one micro-batch (grad_accum and pipeline split the batch)
  length: int  # tokens per sequence on this device (sequence sharding splits it)
  full_length: int
  embed: int
  mlp: int  # per tensor shard, likewise heads, kv_heads and vocab
  heads: int
  kv_heads: int
  head_dim: int
  vocab: int
  compute_bytes: int
  context: str
  attention_block: int  # model.attention_block: the longest query or key run scored at once
  loss_positions: int  # positions of the local sequence in one chunk of the head and loss (model.loss_chunk)
  mlp_chunks: int  # chunks of positions a dense MLP runs in (model.mlp_chunk; 1: the whole sequence)

  @property
  def keys(self) -> int:
    """Keys each query scores: the whole sequence, except the ring's one block at a time."""
    return self.length if self.context == "ring" else self.full_length

  @property
  def blockwise(self) -> bool:
    """Whether attention keeps no scores for its backward pass, only its output and log-sum-exp: longer
    than one block (model/attention.py), or the ring, whose backward pass is its own (parallel/context.py)."""
    return self.context == "ring" or max(self.length, self.keys) > self.attention_block

  @property
  def tokens(self) -> int:
    return self.batch * self.length

  def activation_bytes(self, width: int) -> int:
    """One [batch, length, width] activation in the compute dtype."""
    return self.tokens * width * self.compute_bytes


def dims(config, mesh: dict) -> Dims:
  m, tensor = config.model, mesh[TENSOR]
  micro = config.grad_accum * (config.pipeline.microbatches if mesh[PIPELINE] > 1 else 1)
  padded_vocab = -(-m.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  batch = config.batch_size // micro // (mesh[DATA] * mesh[EXPERT])
  return Dims(mesh=mesh, batch=batch,
              length=m.max_len // mesh[SEQUENCE], full_length=m.max_len, embed=m.embed_dim,
              mlp=m.mlp_dim // tensor, heads=m.num_heads // tensor,
              kv_heads=(m.kv_heads or m.num_heads) // tensor, head_dim=m.embed_dim // m.num_heads,
              vocab=padded_vocab // tensor, compute_bytes=_compute_bytes(config),
              context=config.attention.context if mesh[SEQUENCE] > 1 else "none",
              attention_block=m.attention_block,
              loss_positions=m.max_len // mesh[SEQUENCE] // chunk_count(
                  m.max_len, chunk_positions(m.loss_chunk, batch, mesh[SEQUENCE])),
              mlp_chunks=chunk_count(m.max_len, chunk_positions(m.mlp_chunk, batch, mesh[SEQUENCE])) if m.mlp_chunk else 1)


def shard_elements(weight: Weight, mesh: dict, table) -> int:
  """Elements of one weight on one device when laid out by a rules table."""
  spec = rules.spec(weight.axes, table)
  size = 1
  for dim, entry in zip(weight.shape, tuple(spec) + (None,) * len(weight.shape)):
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    size *= -(-dim // math.prod(mesh[a] for a in axes))
  return size


def sharded_over(weight: Weight, mesh: dict, table) -> set[str]:
  return {a for e in rules.spec(weight.axes, table) if e
          for a in ((e,) if isinstance(e, str) else e) if mesh[a] > 1}


def memory(config, mesh: dict, weights: list[Weight]) -> dict[str, int]:
  """Per-device bytes: params, gradients, optimizer state, batch, saved activations."""
  zero, axis, d = config.sharding.zero, rules.fsdp_axis(config.sharding), dims(config, mesh)
  params = sum(shard_elements(w, mesh, rules.weight_rules(zero, axis)) for w in weights) * MASTER_BYTES
  moments = (sum(shard_elements(w, mesh, rules.optimizer_rules(zero, axis)) for w in weights)
             * np.dtype(config.precision.moments).itemsize)
  if config.optimizer.name not in ADAM_MOMENTS:
    raise ValueError(f"optimizer.name={config.optimizer.name!r} has no memory estimate.")
  local_batch = config.batch_size // (mesh[DATA] * mesh[EXPERT])
  # Accumulating micro-batches holds the running sum beside each micro-batch's gradients.
  return {"params": params, "grads": params * (2 if config.grad_accum > 1 else 1),
          "opt_state": moments * ADAM_MOMENTS[config.optimizer.name],
          "batch": 2 * local_batch * d.length * INT32_BYTES,
          "activations": activations(config, d, weights)}


def _layer_saved_bytes(config, d: Dims, weights: list[Weight]) -> int:
  """Bytes one layer saves for its backward pass per micro-batch, without remat.

  Counted from what jax's autodiff saves for these blocks (`saved_residuals`):
  per token, eight values of width D (the norms' float32 internals, the block
  input and the residual after attention), Q, K, V and the attention output
  (GPT-2; Llama saves Q and K with and without rotary), the MLP's hidden
  values (tanh-GELU: five; SwiGLU: six), and per attention score three float32
  values (logits, exponentials, probabilities) and one in the compute dtype;
  blockwise attention keeps no scores, only its float32 output and log-sum-exp.
  A chunked MLP (model.mlp_chunk) keeps neither its hidden values nor its
  norm's three float32 values, only while it recomputes one chunk of them.
  Below float32 the step also keeps each layer's weight matrices cast to the
  compute dtype. XLA on the CPU keeps all of it; a fusing backend may keep less.
  """
  c, f32, gated = d.compute_bytes, 4, FAMILIES[config.model.family].gated_mlp
  heads = (2 * d.heads + 2 * d.kv_heads) * d.head_dim * c  # queries, outputs; keys, values
  mlp = (6 if gated else 5) * d.mlp * c
  scores = d.heads * (d.head_dim + 1) * f32 if d.blockwise else d.heads * d.keys * (3 * f32 + c)
  feed_forward = mlp + 3 * d.embed * f32
  per_token = 3 * d.embed * f32 + 2 * d.embed * c + heads + scores
  return (d.tokens * per_token + d.tokens // d.mlp_chunks * feed_forward
          + (_cast_weight_bytes(config, d.mesh, weights) if c < 4 else 0))


def _mlp_inputs(config) -> int:
  """Hidden values per MLP position whose gradients its backward pass makes: GELU's input and output,
  SwiGLU's gate, up projection and their product."""
  return 3 if FAMILIES[config.model.family].gated_mlp else 2


def _cast_weight_bytes(config, mesh, weights) -> int:
  """One layer's matrices in the compute dtype, as the step uses them (gathered under FSDP)."""
  layers = config.model.num_layers // mesh[PIPELINE]
  return sum(shard_elements(w, mesh, rules.weight_rules(0)) for w in weights
             if w.stacked and len(w.shape) > 2) // layers * _compute_bytes(config)


def _compute_bytes(config) -> int:
  """Bytes per activation value: float8 multiplies in fp8 but keeps its activations in bfloat16."""
  return 2 if config.precision.compute == "float8" else np.dtype(config.precision.compute).itemsize


def _remat_saved_bytes(config, d: Dims, weights: list[Weight]) -> int:
  """What one layer keeps per micro-batch under the remat policy."""
  policy = config.model.remat
  if policy == "none":
    return _layer_saved_bytes(config, d, weights)
  if policy == "full":
    return d.activation_bytes(d.embed)  # the block input only
  if policy == "full_offload":
    return 0  # the block input waits in host memory (host_memory); the device holds one layer's at a time
  if policy == "save_dots":
    # The block input and the weight matmuls' outputs: QKV, attention projection, MLP in (and gate) and out.
    mlp_in = (2 if FAMILIES[config.model.family].gated_mlp else 1) * d.mlp
    qkv = (d.heads + 2 * d.kv_heads) * d.head_dim
    return d.activation_bytes(d.embed + qkv + 2 * d.embed + mlp_in)
  if policy == "save_attention":
    return d.activation_bytes(d.embed + d.heads * d.head_dim)  # the block input and attention's output
  if policy == "offload":
    return d.activation_bytes(d.embed)  # attention's output waits in host memory, not on the device
  raise ValueError(f"model.remat={policy!r} has no memory estimate.")


def _held_layers(config, mesh: dict) -> tuple[int, int]:
  """(copies, layers): how many micro-batches' residuals a device holds at once, each for this many
  layers. One without a pipeline; 1F1B's stash slots; GPipe's and the interleaved schedule's every
  tick of the stage loop, each for the layers of one virtual stage."""
  layers, stages = config.model.num_layers // mesh[PIPELINE], mesh[PIPELINE]
  if stages == 1:
    return 1, layers
  micro = config.pipeline.microbatches
  if config.pipeline.schedule == "1f1b":
    return schedules.stash_slots(stages=stages, micro=micro), layers
  virtual = config.pipeline.virtual_stages if config.pipeline.schedule == "interleaved" else 1
  return schedules.circular_ticks(stages=stages, virtual=virtual, micro=micro), layers // virtual


def host_memory(config, mesh: dict) -> int:
  """Per-device bytes the remat policy parks in pinned host memory: each layer's offloaded values,
  for every micro-batch whose residuals are held at once (as `activations` counts them on the device)."""
  d, policy = dims(config, mesh), config.model.remat
  per_layer = {"full_offload": d.activation_bytes(d.embed),
               "offload": d.tokens * d.heads * d.head_dim * d.compute_bytes}.get(policy, 0)
  copies, layers = _held_layers(config, mesh)
  return copies * layers * per_layer


def _loss_bytes(d: Dims) -> int:
  """The head and loss running backward over one chunk: the chunk's logits in float32 three times
  (logits, exponentials, their gradient) and in the compute dtype twice, the head input's gradient, and
  the head weight's float32 gradient for the chunk beside the running sum (counted in `grads`)."""
  logits = d.batch * d.loss_positions * d.vocab * (3 * 4 + 2 * d.compute_bytes)
  return logits + d.activation_bytes(d.embed) + d.embed * d.vocab * 4


def activations(config, d: Dims, weights: list[Weight]) -> int:
  """Activations saved for the backward pass, and the larger of one layer's backward working set and the loss's.

  The loss runs backward before any layer does, so its chunk's logits are
  gone by the time a layer's working set is live. A layer's backward pass
  holds what the layer saved (recomputed, under remat) and the gradients it
  makes: while its MLP runs backward, the MLP's hidden gradients; while its
  attention runs backward, the query gradient in float32 beside the output's
  gradient, the residual stream's gradient in float32 going in and coming
  out, and for blockwise attention one block pair's scores and the keys' and
  values' float32 gradients. Checked against the compiled program
  (`tools/longest_context.py --compile`: the 1B Llama at the lengths the
  longest-context table gives, and `tools/context_memory.py --estimate`).
  """
  mesh, layers = d.mesh, config.model.num_layers // d.mesh[PIPELINE]
  loss = _loss_bytes(d)
  residuals = _layer_saved_bytes(config, d, weights)
  mlp = residuals + d.tokens // d.mlp_chunks * _mlp_inputs(config) * d.mlp * d.compute_bytes
  attention = residuals + d.tokens * (d.heads * d.head_dim * (4 + d.compute_bytes) + 2 * d.embed * 4)
  if d.blockwise:
    blocks = largest_divisor(d.length, d.attention_block) * largest_divisor(d.keys, d.attention_block)
    # One block pair's float32 scores, probabilities and their gradients, and the keys' and values'
    # float32 gradients, which the backward pass accumulates over every query block.
    attention += 4 * d.batch * blocks * d.heads * 4 + 2 * d.batch * d.keys * d.kv_heads * d.head_dim * 4
  if d.context == "allgather":
    # The whole sequence's keys and values as gathered, in the compute dtype; below float32 also as
    # the blocks the attention scans and as their gradients cast back for the reduce-scatter (in
    # float32 those are the gathered buffer's own and the float32 gradients above).
    gathered = 3 if d.compute_bytes < 4 else 1
    attention += gathered * 2 * d.batch * d.keys * d.kv_heads * d.head_dim * d.compute_bytes
  if d.context == "ring":
    # The ring's backward pass: the visiting K/V block and its float32 gradients, each as sent and as
    # received, and the query gradient's running sum beside this hop's share.
    attention += d.tokens * (4 * d.kv_heads * d.head_dim * (d.compute_bytes + 4) + 2 * d.heads * d.head_dim * 4)
  working = max(mlp, attention)
  saved, (copies, held) = _remat_saved_bytes(config, d, weights), _held_layers(config, mesh)
  if mesh[PIPELINE] == 1:
    return held * saved + max(working, loss)
  stages, micro = mesh[PIPELINE], config.pipeline.microbatches
  if config.pipeline.schedule == "1f1b":
    # The head runs on 1/P of each micro-batch's tokens, as one row chunked by model.loss_chunk.
    tokens = d.batch * d.length // stages
    chunk = tokens // chunk_count(tokens, chunk_positions(config.model.loss_chunk, d.batch, 1))
    # Every micro-batch's chunk of float32 logits, exponentials and their gradient stays until its backward tick.
    loss = 3 * chunk * d.vocab * 4 + d.activation_bytes(d.embed) // stages
    # Each stashed micro-batch's residuals; the weights' casts to the compute dtype are kept once.
    casts = layers * _cast_weight_bytes(config, mesh, weights) if (
        config.model.remat == "none" and d.compute_bytes < 4) else 0
    return copies * (held * saved - casts) + casts + working + micro * loss
  # The head runs after the stage loop on 1/P of the batch's rows.
  loss = loss * micro // stages
  # Autodiff through the tick loop saves every tick's stage activations, bubble ticks included (zeros
  # where the cond skipped the stage), and the chunk of weights each tick slices out for its stage.
  chunk = _stage_weight_bytes(config, mesh, weights) * held // layers
  return copies * (held * saved + chunk) + working + loss


def _stage_weight_bytes(config, mesh, weights) -> int:
  """The stacked weights one stage holds, whole over `data`, in the parameter dtype."""
  return sum(shard_elements(w, mesh, rules.weight_rules(0)) for w in weights if w.stacked) * \
      MASTER_BYTES


def _axes_key(axes) -> str:
  return "+".join(a for a in AXES if a in axes) or "-"


def _all_reduce(n: int, d: int) -> int:
  return 2 * n * (d - 1) // d


def _gather(n: int, d: int) -> int:
  """All-gather or reduce-scatter of a buffer whose full size is n."""
  return n * (d - 1) // d


def collectives(config, mesh: dict, weights: list[Weight]) -> dict[tuple[str, str], int]:
  """Ring bytes one device sends per step, by (kind, axes)."""
  traffic = collections.Counter()
  _gradients(config, mesh, weights, traffic)
  _tensor_parallel(config, mesh, traffic)
  _pipeline(config, mesh, weights, traffic)
  _context(config, mesh, traffic)
  _experts(config, mesh, traffic)
  return {key: value for key, value in traffic.items() if value}


def _gradients(config, mesh, weights, traffic):
  """Data parallelism and ZeRO: gradients summed over every axis that splits the tokens.

  ZeRO-0 all-reduces each gradient. With ZeRO-1/3 a weight whose moments live
  on `data` (hybrid sharding: its groups on `expert`) has its gradient reduce-scattered there (the other token axes
  all-reduce the shard); ZeRO-1 then all-gathers the updated weights, ZeRO-3
  all-gathers each weight where it is used (in the dtype it is used in):
  stacked layers once in the forward loop and once in the backward loop, the
  rest once. Each micro-batch
  of gradient accumulation reduces its own gradients. A tied embedding is used
  twice (lookup and head): XLA all-reduces the two uses' gradients apart,
  but sums them before a reduce-scatter. A pipeline (parallel/pipeline.py)
  reduces once per step what its devices summed locally: the weights outside
  the stages over `pipeline` as well (the tied embedding's two uses
  together), and under ZeRO-3 gathers every weight once.
  """
  zero, accum, pipelined = config.sharding.zero, config.grad_accum, mesh[PIPELINE] > 1
  axis = rules.fsdp_axis(config.sharding)  # where ZeRO shards: `data`, or hybrid sharding's groups
  param_bytes = MASTER_BYTES
  token_axes = {a for a in (DATA, EXPERT, SEQUENCE) if mesh[a] > 1}
  tied = FAMILIES[config.model.family].tied_head
  for w in weights:
    # The weight as the step uses it: sharded over tensor and pipeline, whole over data.
    used = shard_elements(w, mesh, rules.weight_rules(0)) * param_bytes
    fsdp = zero == 3 and axis in sharded_over(w, mesh, rules.weight_rules(3, axis))
    scatter = axis in token_axes and axis in sharded_over(w, mesh, rules.optimizer_rules(zero, axis))
    uses = 2 if tied and w.axes == ("vocab", "embed") and not (scatter or pipelined) else 1
    # An expert weight lives on its experts' devices: its gradient is summed over the other token axes.
    # Under a pipeline the weights outside the stages are also summed over `pipeline`.
    replicas = ((token_axes - sharded_over(w, mesh, rules.weight_rules(0)) - ({axis} if scatter else set()))
                | ({PIPELINE} if pipelined and not w.stacked else set()))
    grad = used
    if scatter:
      traffic[("reduce-scatter", axis)] += accum * uses * _gather(used, mesh[axis])
      grad //= mesh[axis]
    if replicas:
      group = math.prod(mesh[a] for a in replicas)
      traffic[("all-reduce", _axes_key(replicas))] += accum * uses * _all_reduce(grad, group)
    if scatter and zero == 1:
      traffic[("all-gather", axis)] += _gather(used, mesh[axis])
    if fsdp:
      gathered = used // param_bytes * _gathered_bytes(config, w, weights)
      traffic[("all-gather", axis)] += accum * (2 if w.stacked and not pipelined else 1) * _gather(gathered, mesh[axis])


def _gathered_bytes(config, w: Weight, weights: list[Weight]) -> int:
  """Bytes per element ZeRO-3 gathers a weight in: the partitioner gathers after the cast where it is used.

  The layers' matrices and the head (GPT-2's tied table: gathered once, cast for the logits; its
  lookup reads the table's local columns) multiply in the compute dtype; norms, biases and the
  position table are gathered as float32 (norms compute in float32; biases are a few KiB).
  """
  multiplied = (w.stacked and _is_matrix(w)) or w in _head(config, weights)
  return _compute_bytes(config) if multiplied else MASTER_BYTES


def _layer_passes(config, mesh) -> tuple[int, int]:
  """(forward, backward) runs of one device's layers per step, counted in micro-batches.

  Recomputation (a remat policy) runs the forward again.
  """
  # A pipeline stage runs each micro-batch once; its idle ticks are skipped (lax.cond).
  forward = config.grad_accum * (config.pipeline.microbatches if mesh[PIPELINE] > 1 else 1)
  backward = forward
  return forward * (2 if config.model.remat in ("full", "full_offload") else 1), backward


def _tensor_parallel(config, mesh, traffic):
  """Megatron-LM: per layer, the attention and MLP outputs are all-reduced forward, their inputs' gradients backward.

  Each device's matmul rounds its float32 accumulation to the compute dtype
  before the sum (model/layers.py), so these carry the compute dtype, as in
  Megatron-LM. Outside the layers: the vocabulary-sharded embedding lookup
  forward (float32: the table is gathered before the cast), the head's input
  gradient backward (compute dtype), and the softmax's max, sum and the
  loss's contraction over the vocabulary, each a float32 value per token;
  a pipeline's stages run the head on 1/P of the tokens each.
  """
  if mesh[TENSOR] == 1:
    return
  d, t = dims(config, mesh), mesh[TENSOR]
  forward, backward = _layer_passes(config, mesh)
  layers = config.model.num_layers // mesh[PIPELINE]
  per_layer = 2 * _all_reduce(d.activation_bytes(d.embed), t)
  outside = d.tokens * d.embed * 4 + (d.tokens * 4 * 4 + d.activation_bytes(d.embed)) // mesh[PIPELINE]
  micro = config.grad_accum * (config.pipeline.microbatches if mesh[PIPELINE] > 1 else 1)
  traffic[("all-reduce", TENSOR)] += ((forward + backward) * layers * per_layer
                                      + micro * _all_reduce(outside, t))


def _pipeline(config, mesh, weights, traffic):
  """Stage-to-stage hand-offs of one micro-batch's activations, and the head's rows.

  gpipe / interleaved: one permute per tick forward and its transpose
  backward; an all-to-all scatters the last stage's outputs over the stages
  for the head, and its transpose brings their gradients back. 1f1b: a
  forward and a backward permute per tick, and per tick the all-to-all that
  shares the finished micro-batch's head over the stages, and its transpose. (The gradients' reduction is
  `_gradients`'.)
  """
  stages = mesh[PIPELINE]
  if stages == 1:
    return
  d, micro, accum = dims(config, mesh), config.pipeline.microbatches, config.grad_accum
  hop = d.activation_bytes(d.embed)
  if config.pipeline.schedule == "1f1b":
    ticks = schedules.one_f_one_b_ticks(stages=stages, micro=micro)
    traffic[("all-to-all", PIPELINE)] += accum * 2 * ticks * _gather(hop, stages)
  else:
    virtual = config.pipeline.virtual_stages if config.pipeline.schedule == "interleaved" else 1
    ticks = schedules.circular_ticks(stages=stages, virtual=virtual, micro=micro)
    traffic[("all-to-all", PIPELINE)] += accum * 2 * _gather(micro * hop, stages)
  traffic[("collective-permute", PIPELINE)] += accum * 2 * ticks * hop


def _context(config, mesh, traffic):
  """Attention over a sharded `length`: per layer, forward and backward.

  allgather: K and V gathered forward, their gradients reduce-scattered
  backward. ring: S-1 hops of a K/V block (with its positions) forward, and
  backward S-1 hops of the block with its float32 gradients and one more of
  the gradients alone. ulysses: Q, K, V and the output each cross one
  all-to-all forward and one backward.
  """
  shards = mesh[SEQUENCE]
  if shards == 1:
    return
  d, strategy = dims(config, mesh), config.attention.context
  forward, backward = _layer_passes(config, mesh)
  layers = config.model.num_layers
  kv = d.activation_bytes(d.kv_heads * d.head_dim)
  q = d.activation_bytes(d.heads * d.head_dim)
  if strategy == "allgather":
    traffic[("all-gather", SEQUENCE)] += forward * layers * 2 * _gather(kv * shards, shards)
    traffic[("reduce-scatter", SEQUENCE)] += backward * layers * 2 * _gather(kv * shards, shards)
  elif strategy == "ring":
    block = 2 * kv + d.length * INT32_BYTES
    gradients = 2 * d.tokens * d.kv_heads * d.head_dim * 4  # float32, carried with the block
    traffic[("collective-permute", SEQUENCE)] += layers * (
        forward * (shards - 1) * block + backward * ((shards - 1) * (block + gradients) + gradients))
  elif strategy == "ulysses":
    traffic[("all-to-all", SEQUENCE)] += (forward + backward) * layers * _gather(2 * q + 2 * kv, shards)
  else:
    raise ValueError(f"attention.context={strategy!r} has no collective estimate.")


def _experts(config, mesh, traffic):
  """Expert parallelism (parallel/experts.py): per MoE layer, the tokens laid out per expert.

  Each device's (E, batch, capacity, embed) slots, in the compute dtype,
  cross one all-to-all over `expert` to their experts and one back, forward
  and again backward; capacity per sequence as model/moe.py sizes it.
  """
  if mesh[EXPERT] == 1 or not config.moe.experts:
    return
  d, m = dims(config, mesh), config.moe
  forward, backward = _layer_passes(config, mesh)
  layers = config.model.num_layers // m.every // mesh[PIPELINE]
  capacity = moe.slots(d.full_length, m.experts, m.top_k, m.capacity_factor, m.dropless)
  tokens = m.experts * d.batch * capacity * d.embed * d.compute_bytes
  traffic[("all-to-all", EXPERT)] += (forward + backward) * layers * 2 * _gather(tokens, mesh[EXPERT])


def _is_matrix(w: Weight) -> bool:
  """A weight the tokens multiply: an `embed` axis and another beside `layers` and `expert` (not a bias or norm)."""
  return "embed" in w.axes and any(a not in ("embed", "layers", "expert") for a in w.axes)


def _head(config, weights) -> list[Weight]:
  """The logits' weight: GPT-2's tied token table (vocab, embed), Llama's (embed, vocab) head; a lookup is no matmul."""
  axes = ("vocab", "embed") if FAMILIES[config.model.family].tied_head else ("embed", "vocab")
  return [w for w in weights if w.axes == axes]


def _stage_forward(config, d: Dims, mesh, weights) -> dict[str, int]:
  """Forward matmul FLOPs of one device's layers on one micro-batch, by part.

  dense: the layers' weight matrices, 2 FLOPs per element per token (QKV, out, MLP, router); mlp_in and
  mlp_out, the MLP's input (and gate) and output projections, are part of it. scores and values: QK^T and PV over the full T x T, 2 x T x
  heads x head_dim per token each: attention masks the causal half rather than skipping it (the zig-zag
  ring skips the fully masked half of each visiting block).
  experts: each device's experts over their capacity slots (E x capacity per sequence of every expert
  shard's batch); dispatch and combine: the tokens to and from the slots, 2 x E x capacity x embed per
  token each.
  """
  layers = config.model.num_layers // mesh[PIPELINE]
  matrices = lambda keep: sum(shard_elements(w, mesh, rules.weight_rules(0)) for w in weights
                              if w.stacked and _is_matrix(w) and keep(w))
  attention = 2 * d.tokens * d.full_length * d.heads * d.head_dim * layers
  if d.context == "ring":  # its own block whole, and half of each of the S - 1 visitors (the rest is masked)
    attention = attention * (mesh[SEQUENCE] + 1) // (2 * mesh[SEQUENCE])
  parts = {"dense": 2 * d.tokens * matrices(lambda w: "expert" not in w.axes),
           "mlp_in": 2 * d.tokens * matrices(lambda w: "expert" not in w.axes and w.axes[-2:] == ("embed", "mlp")),
           "mlp_out": 2 * d.tokens * matrices(lambda w: "expert" not in w.axes and w.axes[-2:] == ("mlp", "embed")),
           "scores": attention, "values": attention}
  m = config.moe
  if m.experts:
    slots = moe.slots(d.full_length, m.experts, m.top_k, m.capacity_factor, m.dropless)
    moe_layers = layers // m.every
    parts["experts"] = 2 * mesh[EXPERT] * d.batch * slots * matrices(lambda w: "expert" in w.axes)
    parts["dispatch"] = parts["combine"] = 2 * d.tokens * m.experts * slots * d.embed * moe_layers
  return parts


_PARTS_OF_DENSE = ("mlp_in", "mlp_out")  # parts already counted in "dense"


def _recomputed(config, parts: dict[str, int]) -> int:
  """Forward FLOPs the backward pass runs again under model.remat, per micro-batch.

  jax recomputes only what the backward pass reads: never the block's last matmul (the MLP's output
  projection, or MoE's combine), whose output is only added to the residual. full: the rest of the
  block (full_offload too). save_dots (weight matmuls saved): the batched dots, attention's QK^T and PV and MoE's
  dispatch and experts. save_attention and offload (attention's output kept): the rest but PV.
  """
  policy, last = config.model.remat, parts.get("combine", parts["mlp_out"])
  everything = sum(v for k, v in parts.items() if k not in _PARTS_OF_DENSE)
  # A chunked MLP (model.mlp_chunk) reruns its input projections in the backward pass whatever the policy.
  chunked = parts["mlp_in"] if config.model.mlp_chunk and policy in ("none", "save_dots") else 0
  if policy == "none":
    return chunked
  if policy in ("full", "full_offload"):
    return everything - last
  if policy == "save_dots":
    return parts["scores"] + parts["values"] + parts.get("dispatch", 0) + parts.get("experts", 0) + chunked
  if policy in ("save_attention", "offload"):
    return everything - last - parts["values"]
  raise ValueError(f"model.remat={policy!r} has no FLOPs estimate.")


def flops(config, mesh: dict, weights: list[Weight]) -> dict[str, int]:
  """Matmul FLOPs per step of the busiest device, by part: layers, head, recompute, total.

  Every matmul runs forward once and backward twice (the input's gradient and the weight's). The
  layers run on each micro-batch (a pipeline stage only on its busy ticks); the head (the logits'
  matmul, tied to the token table in GPT-2) on the device's whole batch, which the stages of a
  pipeline share (1/P of the tokens each). The embedding lookup is a gather, no
  matmul. Recompute: the remat policy's and ring attention's visiting blocks (1F1B stashes its
  stage's residuals instead of rerunning the forward).
  """
  d = dims(config, mesh)
  _, runs = _layer_passes(config, mesh)  # micro-batches each layer runs forward and backward
  parts = _stage_forward(config, d, mesh, weights)
  forward = sum(v for k, v in parts.items() if k not in _PARTS_OF_DENSE)
  recompute = _recomputed(config, parts)
  if d.context == "ring":  # its backward recomputes every visited block's QK^T from the log-sum-exp, as flash does
    recompute += parts["scores"]
  head_tokens = config.batch_size // (mesh[DATA] * mesh[EXPERT]) * d.length // mesh[PIPELINE]
  head = 3 * 2 * head_tokens * sum(shard_elements(w, mesh, rules.weight_rules(0)) for w in _head(config, weights))
  out = {"layers": runs * 3 * forward, "head": head, "recompute": runs * recompute}
  return {**out, "total": sum(out.values())}


def ideal_flops(config, mesh: dict, weights: list[Weight]) -> int:
  """The textbook's FLOPs per device per step: the whole step's over every device, remat none.

  6N per token, N the matmul parameters a token uses (the layers' matrices, a MoE layer's top-k
  experts, and the head; the embedding lookup is no matmul), plus attention's 12 x layers x T x
  heads x head_dim per token (QK^T and PV over the full T x T, as XLA's masked attention computes
  them; PaLM's count, and training/metrics.py's MFU).
  """
  m = config.model
  dense = sum(math.prod(w.shape) for w in weights if w.stacked and _is_matrix(w) and "expert" not in w.axes)
  experts = sum(math.prod(w.shape) for w in weights if w.stacked and _is_matrix(w) and "expert" in w.axes)
  active = experts * config.moe.top_k // config.moe.experts if config.moe.experts else 0
  head = sum(math.prod(w.shape) for w in _head(config, weights))
  per_token = 6 * (dense + active + head) + 12 * m.num_layers * m.max_len * m.embed_dim
  return config.batch_size * m.max_len * per_token // math.prod(mesh.values())
