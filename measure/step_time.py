"""How long a step takes on a cluster, by arithmetic: tokens/s and MFU for any config and layout.

Beside the memory estimate (measure/estimate.py), from the same per-device figures:
- compute: each part of the busiest device's step (`parts`: the GEMMs, attention,
  the pointwise work between them, the saved values read back, the loss, the
  optimizer's update) takes the larger of its FLOPs at the device's peak times an
  achievable fraction, calibrated once per device kind (measure/calibration.py),
  and its bytes over the device's HBM bandwidth (its datasheet figure,
  measure/hardware.py); `bytes_moved` says what each part reads and writes;
- communication: each collective's ring bytes split by network tier
  (measure/tiers.py) over that tier's bandwidth per device, plus a per-hop
  latency for each call;
- the pipeline's bubble: a pipelined step's layers take 1 / (1 - bubble) of
  their busy time, bubble = (P - 1) / (VM + P - 1) (parallel/schedules.py).

What hides behind compute is stated, not fitted:
- data parallelism's gradient reductions run under the backward pass, a layer's
  bucket at a time, so all but the last layer's bucket hide as long as the
  backward pass lasts; under a pipeline they wait for its flush (meshlm reduces
  once per step what its stages summed, as Megatron-LM does), and are exposed.
- ZeRO-3's gathers are prefetched a layer ahead, hiding under the forward and
  backward passes all but the first layer's; ZeRO-1's gather of the updated
  weights follows the optimizer and is exposed.
- ring attention's hops hide under the attention of the block in hand.
- the offloading remat policies' copies to host memory and back hide under
  both passes, all but a layer's.
- everything else is exposed: tensor parallelism's all-reduces and the
  all-to-alls of Ulysses and of experts sit between the matmuls that need them,
  and a pipeline's hand-offs between its ticks.
"""

import dataclasses
import math

from measure import estimate, memory, tiers
from measure.sizes import blocks_run, head_weights, is_matrix, replaced, routed_blocks, run_of
from measure.hardware import Cluster
from parallel import context, experts, rules, schedules
from parallel.costs import shard_elements
from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE

# Seconds per hop of a ring step: NCCL's and XLA's collectives pay a few microseconds per step on
# NVLink and ICI and some more across hosts (stated round figures, not measured here; they matter
# only for small messages).
HOP_LATENCY = {"gpu": {tiers.FAST: 5e-6, tiers.SLOW: 10e-6}, "tpu": {tiers.FAST: 1e-6, tiers.SLOW: 10e-6}}

# Bytes/s one way between a GPU and its host's memory, where the offloading remat policies park what
# the backward pass needs: PCIe 4.0 x16 on A100 and PCIe 5.0 x16 on Hopper and Blackwell (16 and 32 GT/s
# per lane, 128b/130b coding: about 32 and 64 GB/s). TPUs' host links are not modeled, so the planner
# does not offload there.
HOST_LINK = {"a100": 32e9, "h100": 64e9, "h200": 64e9, "b200": 64e9}

# Where each source's collectives hide (module docstring): behind the backward pass, behind both passes,
# behind attention, or nowhere.
BACKWARD, BOTH_PASSES, ATTENTION, EXPOSED = "backward", "both passes", "attention", "exposed"


@dataclasses.dataclass(frozen=True)
class StepTime:
  """One step's predicted time on one device, in seconds, and what follows from it."""
  compute: float  # the parts' seconds added up, the busy ticks only
  parts: dict[str, float]  # by part of the step (bytes_moved's): the larger of its FLOPs' and its bytes' seconds
  bubble: float  # a pipeline's idle ticks
  communication: dict[str, float]  # by source (estimate.collectives_by_source): seconds on the links
  exposed: dict[str, float]  # by source: the part that does not hide behind compute
  bytes_by_tier: dict[str, int]  # ring bytes per device per step: "fast", "slow"
  step: float
  tokens_per_second: float  # the whole cluster's
  mfu: float  # the textbook's FLOPs (6N + attention, no recompute) over step x peak
  flops_per_device: int  # matmul FLOPs the busiest device runs per step, recompute included


def hops(kind: str, inside: int, groups: int) -> dict[str, int]:
  """Ring steps of one call, by tier: an all-reduce's 2(a-1) inside and 2(b-1) across, half that for
  gathers and scatters, one step per peer for an all-to-all, one for a permute."""
  if kind == "collective-permute":
    return {tiers.FAST: 1, tiers.SLOW: 0} if groups == 1 else {tiers.FAST: 0, tiers.SLOW: 1}
  if kind == "all-to-all":
    return {tiers.FAST: inside - 1, tiers.SLOW: inside * (groups - 1)}
  rounds = 2 if kind == "all-reduce" else 1
  return {tiers.FAST: rounds * (inside - 1), tiers.SLOW: rounds * (groups - 1)}


def calls(run, mesh: dict, source: str, kind: str, weights: list) -> int:
  """How many times per step a source's collective of `kind` runs: once per layer and pass for the
  collectives inside the layers, per tick for a pipeline's hand-offs, per layer's bucket and micro-batch
  for gradient reductions (as XLA's and DDP's combiners group them)."""
  run = run_of(run)
  forward, backward = estimate.layer_passes(run, mesh)
  layers = estimate.stage_layers(run, mesh)
  per_pass = (forward + backward) * blocks_run(run, mesh)  # multi-token prediction's blocks too
  if source == "tensor":
    return 2 * per_pass
  if source == "context":
    return per_pass * context.STRATEGIES[run.attention.context].calls(mesh[SEQUENCE])
  if source == "experts":
    return experts.CALLS * (forward + backward) * routed_blocks(run, mesh)
  if source == "pipeline":
    p = run.pipeline
    ticks = schedules.SCHEDULES[p.schedule].ticks(stages=mesh[PIPELINE], micro=p.microbatches,
                                                   virtual=schedules.virtual_stages(p))
    return 2 * ticks * run.grad_accum
  if source == "optimizer":  # Muon gathers each matrix's momentum once per step
    return layers
  if source == "stages":  # unequal stages: each stacked weight's all-to-all and its transpose
    return 2 * run.grad_accum * sum(w.stacked for w in weights)
  if kind == "all-gather":  # ZeRO-3 gathers each layer's weights in each pass, ZeRO-1 the updated ones once
    return per_pass if run.sharding.zero == 3 else layers
  return run.grad_accum * layers


def hiding_place(run, mesh: dict, source: str, kind: str) -> str:
  """Where a source's collective of `kind` hides (module docstring)."""
  run = run_of(run)
  if source == "gradients":
    if kind == "all-gather":
      return BOTH_PASSES if run.sharding.zero == 3 else EXPOSED
    return BACKWARD if mesh[PIPELINE] == 1 else EXPOSED
  if source == "context" and kind == "collective-permute":
    return ATTENTION
  return EXPOSED


def collective_seconds(kind: str, axes_key: str, by_tier: dict[str, int], count: int, mesh: dict, slow: dict,
                       cluster: Cluster) -> float:
  """One step's seconds of one (kind, axes): each tier's bytes over its bandwidth per device, and each
  call's hops at the tier's latency. A permute any of whose pairs crosses the slow tier is paced by it."""
  axes = axes_key.split("+")
  groups = math.prod(slow.get(a, 1) for a in axes)
  inside = math.prod(mesh.get(a, 1) for a in axes) // groups
  bandwidth = {tiers.FAST: cluster.kind.fast_link_bandwidth, tiers.SLOW: cluster.slow_link_bandwidth}
  latency = HOP_LATENCY["tpu" if cluster.kind.name.startswith("tpu") else "gpu"]
  if kind == "collective-permute" and by_tier[tiers.SLOW]:
    seconds = (by_tier[tiers.FAST] + by_tier[tiers.SLOW]) / bandwidth[tiers.SLOW]
  else:
    seconds = sum(by_tier[t] / bandwidth[t] for t in bandwidth)
  steps = hops(kind, inside, groups)
  return seconds + count * sum(steps[t] * latency[t] for t in latency)


def host_link_bandwidth(cluster: Cluster) -> float | None:
  return HOST_LINK.get(cluster.kind.name)


def offload_seconds(run, mesh: dict, cluster: Cluster) -> float:
  """Seconds per step of the offloading remat policies' copies: each layer's offloaded values out in the
  forward pass and back in the backward pass, per micro-batch, over the host link."""
  run = run_of(run)
  saved = estimate.saved_per_layer(run, mesh)["host"]
  if not saved:
    return 0.0
  bandwidth = host_link_bandwidth(cluster)
  if bandwidth is None:
    raise ValueError(f"model.remat={run.model.remat} offloads to host memory, whose link on "
                     f"{cluster.kind.name} has no figure here; plan with a policy that keeps to the device.")
  forward, _ = estimate.layer_passes(run, mesh)
  runs = forward // (2 if run.model.remat == "full_offload" else 1)
  return 2 * saved * runs * estimate.stage_layers(run, mesh) / bandwidth


def peak_flops(run, cluster: Cluster) -> float:
  """The device's peak for the step's compute dtype: fp8's for float8 where the device has it."""
  run = run_of(run)
  compute = run.model.compute_dtype
  if compute == "float32":
    raise ValueError("precision.compute=float32 has no step-time model (peak figures are for bf16 and fp8 "
                     "tensor cores); plan with precision.compute=bfloat16.")
  if compute == "float8" and cluster.kind.fp8_flops:
    return cluster.kind.fp8_flops
  return cluster.kind.bf16_flops


def predict(run, mesh: dict, slow: dict, cluster: Cluster, weights: list, achievable: float,
            attention_slowdown: float = 1.0) -> StepTime:
  """The step's time on `cluster` for `config` on `mesh` (axis sizes after hybrid sharding), `slow` its
  slow-tier groups per axis (parallel.mesh.slow_tier_shape), `achievable` the fraction of peak the
  device's matmuls reach (measure/calibration.py). `attention_slowdown`: how many times longer
  attention's FLOPs (QK^T and PV) take than the weight matmuls'; 1 for fused (flash-style) attention,
  which meshlm and the calibration runs use, more for attention that writes its scores to memory."""
  run = run_of(run)
  rate = peak_flops(run, cluster) * achievable
  bandwidth = cluster.kind.hbm_bandwidth
  flops = estimate.flops(run, mesh, weights)
  attention_flops = _attention_flops(run, mesh, weights)
  moved = bytes_moved(run, mesh, weights)
  part_flops = {"gemms": flops["layers"] + flops["recompute"] - attention_flops, "attention": attention_flops,
                "pointwise": 0, "saved": 0, "loss": flops["head"], "optimizer": flops["optimizer"]}
  parts = {part: max(part_flops[part] / rate * (attention_slowdown if part == "attention" else 1),
                     moved[part] / bandwidth) for part in part_flops}
  attention = parts["attention"]
  layers_seconds = sum(parts[part] for part in ("gemms", "attention", "pointwise", "saved"))
  stages = mesh[PIPELINE]
  bubble = 0.0
  if stages > 1:
    p = run.pipeline
    idle = schedules.bubble_over_total(stages=stages, micro=p.microbatches, virtual=schedules.virtual_stages(p))
    bubble = layers_seconds * idle / (1 - idle)
  compute = sum(parts.values())
  # A matmul's backward runs two of its three products; recomputation runs inside the backward pass too.
  backward_seconds = (flops["layers"] * 2 / 3 + flops["recompute"]) / rate
  window = {BACKWARD: backward_seconds, BOTH_PASSES: layers_seconds, ATTENTION: attention, EXPOSED: 0.0}
  layers_per_stage = estimate.stage_layers(run, mesh)
  communication, exposed, totals = {}, {}, dict.fromkeys((tiers.FAST, tiers.SLOW), 0)
  for source, traffic in estimate.collectives_by_source(run, mesh, weights).items():
    split = tiers.split(traffic, mesh, slow, run.pipeline.schedule)
    hidden_by = {}
    for (kind, axes), by_tier in split.items():
      seconds = collective_seconds(kind, axes, by_tier, calls(run, mesh, source, kind, weights), mesh, slow,
                                   cluster)
      place = hiding_place(run, mesh, source, kind)
      hidden_by[place] = hidden_by.get(place, 0.0) + seconds
      for tier in totals:
        totals[tier] += by_tier[tier]
    communication[source] = sum(hidden_by.values())
    # What hides leaves its last (or first) layer's share exposed; the rest shows only beyond its window.
    exposed[source] = sum(seconds if place == EXPOSED else
                          max(seconds - window[place], seconds / layers_per_stage)
                          for place, seconds in hidden_by.items())
  offload = offload_seconds(run, mesh, cluster)
  if offload:
    communication["offload"] = offload
    exposed["offload"] = max(offload - layers_seconds, offload / layers_per_stage)
  step = compute + bubble + sum(exposed.values())
  tokens = run.batch_size * run.model.max_len
  ideal = estimate.ideal_flops(run, mesh, weights)
  return StepTime(compute=compute, parts=parts, bubble=bubble, communication=communication, exposed=exposed,
                  bytes_by_tier=totals, step=step, tokens_per_second=tokens / step,
                  mfu=ideal / (step * peak_flops(run, cluster)), flops_per_device=flops["total"])


def _attention_flops(run, mesh: dict, weights: list) -> int:
  """The attention matmuls' FLOPs per step (QK^T and PV, forward and backward): ring attention's hops
  hide under them."""
  d = estimate.dims(run, mesh)
  forward, backward = estimate.layer_passes(run, mesh)
  parts = estimate.stage_forward(run, d, mesh, weights)
  return (parts["scores"] + parts["values"]) * (forward + 2 * backward)


def bytes_moved(run, mesh: dict, weights: list) -> dict[str, int]:
  """HBM bytes one device reads and writes per step, by part, from the estimator's own accounting.

  - gemms: each weight matrix read in the compute dtype by each forward run and by the backward (the
    input's gradient; the weight's gradient reads activations); their activations are the pointwise work's.
  - attention (fused, flash-style: the scores stay on chip): the queries, keys and values read and the
    output written in the forward; those, the output and its gradient read and the three gradients
    written in the backward.
  - pointwise (the norms, activation functions, residual adds and casts between the GEMMs): each value a
    layer keeps with nothing recomputed (`saved_per_layer` under model.remat=none) written and read once
    per forward run, recomputation's included, and its gradient written and read once in the backward.
  - saved: what the remat policy keeps (`saved_per_layer`) read back once by the backward.
  - loss: the logits written by the head and read by the loss, their gradient written and read by the
    head's two backward products (five passes in the compute dtype), and the head's weight read thrice.
  - optimizer: the float32 parameters and the optimizer's state read and written, the gradients read
    (measure/memory.py's `state`).
  """
  run = run_of(run)
  d = estimate.dims(run, mesh)
  forward, backward = estimate.layer_passes(run, mesh)
  layers = estimate.stage_layers(run, mesh)
  matrices = sum(estimate.stage_elements(run, mesh, w) for w in weights if w.stacked and is_matrix(w))
  attention_unit = d.tokens * d.head_dim * (d.heads + d.kv_heads) * d.compute_bytes * layers
  between = estimate.saved_per_layer(replaced(run, {"model.remat": "none"}), mesh)["device"] * layers
  saved = estimate.saved_per_layer(run, mesh)["device"] * layers
  head_tokens = run.batch_size // (mesh[DATA] * mesh[EXPERT]) * d.length // mesh[PIPELINE]
  head = sum(shard_elements(w, mesh, rules.weight_rules(0)) for w in head_weights(run, weights))
  state = memory.state(run, mesh, weights)
  return {"gemms": (forward + backward) * matrices * d.compute_bytes,
          "attention": 2 * attention_unit * forward + 4 * attention_unit * backward,
          "pointwise": 2 * between * (forward + backward), "saved": saved * backward,
          "loss": (5 * head_tokens * d.vocab + 3 * head) * d.compute_bytes,
          "optimizer": 2 * (state["params"] + state["opt_state"]) + state["grads"]}
