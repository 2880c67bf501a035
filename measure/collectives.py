"""The bytes one device sends per step, by (kind, axes) and by what sends them, under the ring algorithms
(parallel/costs.py): data parallelism's and ZeRO/FSDP's reductions and gathers, Megatron's two all-reduces
per layer each way, and each registered strategy's own collectives as its entry states them (the pipeline
schedule's, the context strategy's, expert dispatch's, the optimizer's). Keys are (kind, axes joined by
"+"), as measure/analysis.py `traffic_per_step` reads them off compiled HLO."""

import collections
import math

from measure.sizes import (adapted, adapter_weights, blocks_run, compute_bytes, dims, expert_slots, head_weights,
                           is_matrix, layer_passes, optimizer_costs, optimizer_of, routed_blocks, routed_layers,
                           run_of, stage_elements, stage_layers, stage_units, stored_table, trained_weights)
from model.mtp import MTP
from parallel import context, experts, rules, schedules
from parallel.costs import (F32_BYTES, MASTER_BYTES, Weight, all_reduce, axes_key, gather, shard_elements,
                            sharded_over)
from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR


def collectives(run, mesh: dict, weights: list[Weight]) -> dict[tuple[str, str], int]:
  """Ring bytes one device sends per step, by (kind, axes)."""
  run = run_of(run)
  traffic = collections.Counter()
  for part in collectives_by_source(run, mesh, weights).values():
    traffic.update(part)
  return dict(traffic)


def collectives_by_source(run, mesh: dict, weights: list[Weight]) -> dict[str, dict[tuple[str, str], int]]:
  """collectives' bytes by what sends them: "gradients" (data parallelism and ZeRO), "tensor",
  "pipeline", "stages" (unequal stages' gathers), "context" (the `sequence` axis), "experts", "optimizer" and
  "adapters" (LoRA's factors);
  a step-time model overlaps each its own way."""
  run = run_of(run)
  out = {}
  for source, count in (("gradients", lambda t: _gradients(run, mesh, weights, t)),
                        ("tensor", lambda t: _tensor_parallel(run, mesh, t)),
                        ("pipeline", lambda t: _pipeline(run, mesh, t)),
                        ("stages", lambda t: _stage_view(run, mesh, weights, t)),
                        ("context", lambda t: _context(run, mesh, t)),
                        ("experts", lambda t: _experts(run, mesh, t)),
                        ("optimizer", lambda t: _optimizer(run, mesh, weights, t)),
                        ("adapters", lambda t: _adapters(run, mesh, weights, t))):
    traffic = collections.Counter()
    count(traffic)
    out[source] = {key: value for key, value in traffic.items() if value}
  return out


def _gradients(run, mesh, weights, traffic):
  """Data parallelism and ZeRO: gradients summed over every axis that splits the tokens.

  ZeRO-0 all-reduces each gradient. With ZeRO-1/3 a weight whose moments live
  on `data` (hybrid sharding: its groups on `expert`) has its gradient reduce-scattered there (the other token axes
  all-reduce the shard); ZeRO-1 then all-gathers the updated weights (and schedule-free's z), ZeRO-3
  all-gathers each weight where it is used (in the dtype it is used in):
  stacked layers once in the forward loop and once in the backward loop, the
  rest once. Each micro-batch
  of gradient accumulation reduces its own gradients. A tied embedding is used
  twice (lookup and head): XLA all-reduces the two uses' gradients apart,
  but sums them before a reduce-scatter; each multi-token prediction module
  (model/mtp.py) uses the weights outside the layers again, reduced or
  scattered apart. A pipeline (parallel/pipeline.py)
  reduces once per step what its devices summed locally: the weights outside
  the stages over `pipeline` as well (the tied embedding's two uses
  together), and under ZeRO-3 gathers every weight once.
  """
  zero, accum, pipelined = run.sharding.zero, run.grad_accum, mesh[PIPELINE] > 1
  axis = rules.fsdp_axis(run.sharding)  # where ZeRO shards: `data`, or hybrid sharding's groups
  param_bytes = MASTER_BYTES
  token_axes = {a for a in (DATA, EXPERT, SEQUENCE) if mesh[a] > 1}
  tied = run.model.traits.tied_head
  for w in weights:
    # The weight as the step's gradients and ZeRO see it: sharded over tensor and pipeline (a stack of
    # unequal stages by `embed`, parallel/stages.py), whole over data.
    table = lambda rule_set: stored_table(run, mesh, w, rule_set)
    used = shard_elements(w, mesh, table(rules.weight_rules(0))) * param_bytes
    # ZeRO splits a weight over its axis only where the weight's own layout does not already (hybrid
    # sharding's groups on `expert` hold a MoE model's experts whole, one set per device, as experts do).
    zero_splits = lambda rule_set: axis in sharded_over(w, mesh, table(rule_set)) - sharded_over(
        w, mesh, table(rules.weight_rules(0)))
    fsdp = zero == 3 and zero_splits(rules.weight_rules(3, axis))
    scatter = axis in token_axes and zero_splits(rules.optimizer_rules(zero, axis))
    uses = 2 if tied and w.axes == ("vocab", "embed") and not (scatter or pipelined) else 1
    if not (w.stacked or pipelined):  # and apart again for each multi-token prediction module's use
      uses *= 1 + run.model.mtp_depth
    # An expert weight lives on its experts' devices: its gradient is summed over the other token axes.
    # Under a pipeline a weight not split over `pipeline` (those outside the stages, and a stack of unequal
    # stages' weights without an `embed` axis) is also summed over it.
    split = sharded_over(w, mesh, table(rules.weight_rules(0)))
    replicas = ((token_axes - split - ({axis} if scatter else set()))
                | ({PIPELINE} if pipelined and PIPELINE not in split else set()))
    grad = used
    # Under LoRA only the adapted weights have a gradient: their merged update's, reduced as a weight's would be.
    reduced = not run.lora or adapted(run, w)
    if scatter and reduced:
      traffic[("reduce-scatter", axis)] += accum * uses * gather(used, mesh[axis])
      grad //= mesh[axis]
    if replicas and reduced:
      group = math.prod(mesh[a] for a in replicas)
      traffic[("all-reduce", axes_key(replicas))] += accum * uses * all_reduce(grad, group)
    if scatter and zero == 1 and not run.lora:
      # The updated weights, and what else the optimizer gathers beside them (training/optimizer.py).
      gathers = optimizer_of(run).gathered
      traffic[("all-gather", axis)] += gathers * gather(used, mesh[axis])
    if fsdp:
      gathered = used // param_bytes * _gathered_bytes(run, w, weights)
      # A scanned stack's forward and backward loops gather apart; the prediction modules are no loop (model/mtp.py).
      scanned = w.stacked and w.path[:1] != (MTP,) and not pipelined
      # A preference objective's reference is gathered again for its one forward pass (its layout is the weights').
      passes = accum * (2 if scanned else 1) + run.reference
      traffic[("all-gather", axis)] += passes * gather(gathered, mesh[axis])


def _adapters(run, mesh, weights, traffic):
  """LoRA's factors (training/lora.py): their gradients are products of the adapted weight's, which arrives summed
  over the token axes; under ZeRO, where that gradient lies scattered over `data` by `embed`, the factor without
  `embed` contracts it over the scattered axis and sums its own there. ZeRO-1 gathers the updated factors."""
  zero, axis = run.sharding.zero, rules.fsdp_axis(run.sharding)
  if not zero or mesh[axis] == 1:
    return
  for w in adapter_weights(run, weights):
    table = lambda rule_set: stored_table(run, mesh, w, rule_set)
    used = shard_elements(w, mesh, table(rules.weight_rules(0))) * MASTER_BYTES
    if "embed" not in w.axes:
      traffic[("all-reduce", axis)] += run.grad_accum * all_reduce(used, mesh[axis])
    if zero == 1 and axis in sharded_over(w, mesh, table(rules.optimizer_rules(zero, axis))):
      traffic[("all-gather", axis)] += optimizer_of(run).gathered * gather(used, mesh[axis])


def _optimizer(run, mesh, weights, traffic):
  """What the update itself sends, as the optimizer's entry states it (training/optimizer.py): Muon's gathers."""
  traffic.update(optimizer_of(run).sent(*optimizer_costs(run, mesh, trained_weights(run, weights))))


def _gathered_bytes(run, w: Weight, weights: list[Weight]) -> int:
  """Bytes per element ZeRO-3 gathers a weight in: the partitioner gathers after the cast where it is used.

  The layers' matrices and the head (GPT-2's tied table: gathered once, cast for the logits; its
  lookup reads the table's local columns) multiply in the compute dtype; norms, biases and the
  position table are gathered as float32 (norms compute in float32; biases are a few KiB).
  """
  multiplied = (w.stacked and is_matrix(w)) or w in head_weights(run, weights)
  return compute_bytes(run) if multiplied else MASTER_BYTES


def _tensor_parallel(run, mesh, traffic):
  """Megatron-LM: per layer, the attention and MLP outputs are all-reduced forward, their inputs' gradients backward.

  Each device's matmul rounds its float32 accumulation to the compute dtype
  before the sum (model/layers.py), so these carry the compute dtype, as in
  Megatron-LM. Outside the layers: the vocabulary-sharded embedding lookup
  forward and the head's input gradient backward (both in the compute dtype:
  the table is cast before its rows are gathered), and the softmax's max, sum and the
  loss's contraction over the vocabulary, each a float32 value per token;
  a pipeline's stages run the head on 1/P of the tokens each.
  """
  if mesh[TENSOR] == 1:
    return
  d, t = dims(run, mesh), mesh[TENSOR]
  forward, backward = layer_passes(run, mesh)
  blocks = blocks_run(run, mesh)  # multi-token prediction's blocks too (model/mtp.py)
  tokens = all_reduce(d.activation_bytes(d.embed), t)
  per_stage = blocks * 2 * tokens  # the attention's and the MLP's output, and their inputs' gradients
  m = run.model
  # Latent attention (model/mla.py) projects its input to latents on every device (replicated weights): the
  # heads' partial gradients are summed where they meet, at the latents (q_rank, or the input where the queries
  # have none, and kv_rank + rope_dim wide), not at the input.
  latents = all_reduce(d.activation_bytes((m.mla_q_rank or d.embed) + m.mla_kv_rank + m.mla_rope_dim), t)
  backward_stage = per_stage + blocks * (latents - tokens) if m.mla_kv_rank else per_stage
  if m.num_experts:
    # A MoE layer's experts sum their slots (E x capacity rows per sequence, _experts'), not its tokens.
    capacity = expert_slots(m, d.full_length)
    slots = all_reduce(m.num_experts * d.batch * capacity * d.embed * d.compute_bytes, t)
    per_stage += routed_blocks(run, mesh) * (slots - tokens)
    backward_stage += routed_blocks(run, mesh) * (slots - tokens)
  outside = (d.activation_bytes(d.embed)
             + (d.tokens * 4 * F32_BYTES + d.activation_bytes(d.embed)) // mesh[PIPELINE])
  micro = schedules.micro_batches(run, mesh[PIPELINE])
  # Each prediction module looks its tokens up and runs the head again.
  traffic[("all-reduce", TENSOR)] += (forward * per_stage + backward * backward_stage
                                      + (1 + m.mtp_depth) * micro * all_reduce(outside, t))
  if run.reference:  # its forward pass: each block's two outputs, the lookup and the softmax's reductions
    traffic[("all-reduce", TENSOR)] += micro * (blocks * 2 * tokens + all_reduce(
        d.activation_bytes(d.embed) + (d.tokens * 3 * F32_BYTES) // mesh[PIPELINE], t))


def _pipeline(run, mesh, traffic):
  """Stage-to-stage hand-offs of one micro-batch's activations, and the head's rows, as the schedule sends
  them (parallel/schedules.py) for each accumulated micro-batch. (The gradients' reduction is `_gradients`'.)"""
  stages = mesh[PIPELINE]
  if stages == 1:
    return
  d, p = dims(run, mesh), run.pipeline
  sent = schedules.SCHEDULES[p.schedule].sent(d.activation_bytes(d.embed), stages=stages, micro=p.microbatches,
                                             virtual=schedules.virtual_stages(p))
  for key, value in sent.items():
    traffic[key] += run.grad_accum * value


def _stage_view(run, mesh, weights, traffic):
  """Unequal stages (parallel/pipeline.py `_stage_view`): per accumulated micro-batch, each stacked weight
  split by `embed` crosses one all-to-all to its stages' devices in float32 and its gradient one back; a
  device receives its chunks' slots whole, (P - 1) / P of them from the others."""
  if stage_units(run, mesh) is None:
    return
  for w in weights:
    if w.stacked and PIPELINE in sharded_over(w, mesh, stored_table(run, mesh, w, rules.weight_rules(0))):
      traffic[("all-to-all", PIPELINE)] += 2 * run.grad_accum * gather(
          stage_elements(run, mesh, w) * MASTER_BYTES, mesh[PIPELINE])


def _context(run, mesh, traffic):
  """Attention over a sharded `length`: per layer, forward and backward, as its strategy sends it
  (parallel/context.py)."""
  shards = mesh[SEQUENCE]
  if shards == 1:
    return
  d = dims(run, mesh)
  forward, backward = layer_passes(run, mesh)
  layers = stage_layers(run, mesh)  # a pipeline stage's
  for key, (in_forward, in_backward) in context.STRATEGIES[run.attention.context].sent(d, shards).items():
    traffic[key] += blocks_run(run, mesh) * (forward * in_forward + backward * in_backward)
  if mesh[PIPELINE] > 1 and run.model.num_experts:
    # In a pipeline stage a MoE layer routes the whole sequence, gathered over `sequence` (parallel/context.py
    # whole_length), and its input's gradient is reduce-scattered back.
    whole = routed_layers(run.model, layers) * gather(d.activation_bytes(d.embed) * shards, shards)
    traffic[("all-gather", SEQUENCE)] += forward * whole
    traffic[("reduce-scatter", SEQUENCE)] += backward * whole


def _experts(run, mesh, traffic):
  """Expert parallelism (parallel/experts.py): per MoE layer and pass, each device's (E, batch, capacity,
  embed) slots, in the compute dtype, sent to their experts and back; capacity per sequence as model/moe.py
  sizes it."""
  if mesh[EXPERT] == 1 or not run.model.num_experts:
    return
  d, m = dims(run, mesh), run.model
  forward, backward = layer_passes(run, mesh)
  layers = routed_blocks(run, mesh)
  capacity = expert_slots(m, d.full_length)
  tokens = m.num_experts * d.batch * capacity * d.embed * d.compute_bytes
  for key, value in experts.sent(tokens, mesh[EXPERT]).items():
    traffic[key] += (forward + backward) * layers * value
