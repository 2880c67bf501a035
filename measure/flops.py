"""The matmul FLOPs of a train step per device, by part: the layers (forward once, backward twice), the
head, what the remat policy and the context strategy recompute, and the optimizer's own (its registered
cost); and the textbook's ideal, 6N per token plus attention."""

import math

from measure.sizes import (blocks_run, dims, expert_slots, head_weights, is_matrix, layer_passes, optimizer_costs,
                           optimizer_of, routed_blocks, run_of, stage_elements, trained_weights)
from parallel import context, rules, schedules
from parallel.costs import Dims, Weight, shard_elements
from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE


def stage_forward(run, d: Dims, mesh, weights) -> dict[str, int]:
  """Forward matmul FLOPs of one device's layers on one micro-batch, by part.

  dense: the layers' weight matrices, 2 FLOPs per element per token (QKV, out, MLP, router); mlp_in and
  mlp_out, the MLP's input (and gate) and output projections, are part of it. scores and values: QK^T and PV over the full T x T, 2 x T x
  heads x head_dim per token each: attention masks the causal half rather than skipping it (the zig-zag
  ring skips the fully masked half of each visiting block).
  experts: each device's experts over their capacity slots (E x capacity per sequence of every expert
  shard's batch); dispatch and combine: the tokens to and from the slots, 2 x E x capacity x embed per
  token each.
  """
  run = run_of(run)
  matrices = lambda keep: sum(stage_elements(run, mesh, w) for w in weights if w.stacked and is_matrix(w) and keep(w))
  # Multi-token prediction's blocks attend as the layers do; their matrices are among the stacked weights already.
  attention = 2 * d.tokens * d.full_length * d.heads * d.head_dim * blocks_run(run, mesh)
  attention = context.scored_flops(d.context, attention, mesh[SEQUENCE])
  parts = {"dense": 2 * d.tokens * matrices(lambda w: "expert" not in w.axes),
           "mlp_in": 2 * d.tokens * matrices(lambda w: "expert" not in w.axes and w.axes[-2:] == ("embed", "mlp")),
           "mlp_out": 2 * d.tokens * matrices(lambda w: "expert" not in w.axes and w.axes[-2:] == ("mlp", "embed")),
           "scores": attention, "values": attention}
  m = run.model
  if m.num_experts:
    slots = expert_slots(m, d.full_length)
    moe_layers = routed_blocks(run, mesh)
    parts["experts"] = 2 * mesh[EXPERT] * d.batch * slots * matrices(lambda w: "expert" in w.axes)
    parts["dispatch"] = parts["combine"] = 2 * d.tokens * m.num_experts * slots * d.embed * moe_layers
  return parts


_PARTS_OF_DENSE = ("mlp_in", "mlp_out")  # parts already counted in "dense"


def _recomputed(run, parts: dict[str, int]) -> int:
  """Forward FLOPs the backward pass runs again under model.remat, per micro-batch.

  jax recomputes only what the backward pass reads: never the block's last matmul (the MLP's output
  projection, or MoE's combine), whose output is only added to the residual. full: the rest of the
  block (full_offload too). save_dots (weight matmuls saved): the batched dots, attention's QK^T and PV and MoE's
  dispatch and experts. save_attention and offload (attention's output kept): the rest but PV.
  """
  policy, last = run.model.remat, parts.get("combine", parts["mlp_out"])
  everything = sum(v for k, v in parts.items() if k not in _PARTS_OF_DENSE)
  # A chunked MLP (model.mlp_chunk) reruns its input projections in the backward pass whatever the policy.
  chunked = parts["mlp_in"] if run.model.mlp_chunk and policy in ("none", "save_dots") else 0
  if policy == "none":
    return chunked
  if policy in ("full", "full_offload"):
    return everything - last
  if policy == "save_dots":
    return parts["scores"] + parts["values"] + parts.get("dispatch", 0) + parts.get("experts", 0) + chunked
  if policy in ("save_attention", "offload"):
    return everything - last - parts["values"]
  raise ValueError(f"model.remat={policy!r} has no FLOPs estimate.")


def flops(run, mesh: dict, weights: list[Weight]) -> dict[str, int]:
  """Matmul FLOPs per step of the busiest device, by part: layers, head, recompute, total.

  Every matmul runs forward once and backward twice (the input's gradient and the weight's). The
  layers run on each micro-batch (a pipeline stage only on its busy ticks); the head (the logits'
  matmul, tied to the token table in GPT-2) on the device's whole batch, which the stages of a
  pipeline share (1/P of the tokens each). The embedding lookup is a gather, no
  matmul. Recompute: the remat policy's and ring attention's visiting blocks (1F1B stashes its
  stage's residuals instead of rerunning the forward).
  """
  run = run_of(run)
  d = dims(run, mesh)
  _, runs = layer_passes(run, mesh)  # micro-batches each layer runs forward and backward
  parts = stage_forward(run, d, mesh, weights)
  forward = sum(v for k, v in parts.items() if k not in _PARTS_OF_DENSE)
  recompute = _recomputed(run, parts)
  if context.visiting(d.context):  # its backward recomputes every visited block's QK^T from the log-sum-exp, as flash does
    recompute += parts["scores"]
  head_tokens = run.batch_size // (mesh[DATA] * mesh[EXPERT]) * d.length // mesh[PIPELINE]
  head_elements = sum(shard_elements(w, mesh, rules.weight_rules(0)) for w in head_weights(run, weights))
  # Each multi-token prediction module scores every position through the head too.
  # A preference objective's head runs a chunk at a time, recomputed in the backward pass (token_log_probs).
  head_passes = 3 if run.objective == "lm" else 4
  head = (1 + run.model.mtp_depth) * head_passes * 2 * head_tokens * head_elements
  out = {"layers": runs * 3 * forward, "head": head, "recompute": runs * recompute,
         "optimizer": optimizer_flops(run, mesh, weights)}
  if run.reference:  # its forward pass over the step's tokens, no backward
    micro = schedules.micro_batches(run, mesh[PIPELINE])
    out["reference"] = micro * forward + 2 * head_tokens * head_elements
  return {**out, "total": sum(out.values())}


def ideal_flops(run, mesh: dict, weights: list[Weight]) -> int:
  """The textbook's FLOPs per device per step: the whole step's over every device, remat none.

  6N per token, N the matmul parameters a token uses (the layers' matrices, a MoE layer's top-k
  experts, and the head; the embedding lookup is no matmul), plus attention's 12 x layers x T x
  heads x head_dim per token (QK^T and PV over the full T x T, as XLA's masked attention computes
  them; PaLM's count, and training/metrics.py's MFU).
  """
  run = run_of(run)
  m = run.model
  dense = sum(math.prod(w.shape) for w in weights if w.stacked and is_matrix(w) and "expert" not in w.axes)
  experts = sum(math.prod(w.shape) for w in weights if w.stacked and is_matrix(w) and "expert" in w.axes)
  active = experts * m.moe_top_k // m.num_experts if m.num_experts else 0
  head = sum(math.prod(w.shape) for w in head_weights(run, weights)) * (1 + m.mtp_depth)
  per_token = 6 * (dense + active + head) + 12 * (m.num_layers + m.mtp_depth) * m.max_len * m.embed_dim
  return run.batch_size * m.max_len * per_token // math.prod(mesh.values())


def optimizer_flops(run, mesh, weights) -> int:
  """The update's matmul FLOPs per device per step (Muon's Newton-Schulz iterations)."""
  run = run_of(run)
  return optimizer_of(run).flops(*optimizer_costs(run, mesh, trained_weights(run, weights)))
