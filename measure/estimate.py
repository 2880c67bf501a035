"""What a train step should cost per device, by arithmetic: memory and collective bytes.

Nothing is compiled or allocated. The weights come in as (shape, logical axes)
pairs, read off the model's abstract (nnx.eval_shape), and what a layer saves
for its backward pass is what jax's autodiff saves when it traces the model's
own block under the remat policy, so the estimate cannot drift from the model;
their per-device size follows the same rules table (parallel/rules.py) the run
shards with. Everything else is the textbook arithmetic of the seeds (MLSysBook
ch. 18, the distributed-training chapter):

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
measure/analysis.py `traffic_per_step` reads them off compiled HLO.
"""

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jax_core

from model import moe
from model.attention import largest_divisor
from model.config import FAMILIES, ModelConfig, VOCAB_MULTIPLE
from model.transformer import chunk_count, chunk_positions, scan_blocks
from parallel import context, experts, rules, schedules
from parallel.costs import (F32_BYTES, INT32_BYTES, MASTER_BYTES, Dims, Weight, all_reduce, axes_key, gather,
                            shard_elements, sharded_over)
from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR
from training import optimizer
from training.state import build_model, model_config


def dims(config, mesh: dict) -> Dims:
  m, tensor = config.model, mesh[TENSOR]
  micro = schedules.micro_batches(config, mesh[PIPELINE])
  padded_vocab = -(-m.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  batch = config.batch_size // micro // (mesh[DATA] * mesh[EXPERT])
  strategy, length = config.attention.context if mesh[SEQUENCE] > 1 else "none", m.max_len // mesh[SEQUENCE]
  # Each query scores the whole sequence, except where the keys visit a block at a time; then attention
  # keeps no scores for its backward pass, as it does past one block (model/attention.py).
  keys = length if context.visiting(strategy) else m.max_len
  return Dims(mesh=mesh, batch=batch, length=length, full_length=m.max_len, keys=keys,
              blockwise=context.visiting(strategy) or max(length, keys) > m.attention_block, embed=m.embed_dim,
              mlp=m.mlp_dim // tensor, heads=m.num_heads // tensor,
              kv_heads=(m.kv_heads or m.num_heads) // tensor,
              head_dim=getattr(m, "head_width", 0) or m.embed_dim // m.num_heads,
              vocab=padded_vocab // tensor, compute_bytes=_compute_bytes(config),
              context=strategy,
              attention_block=m.attention_block,
              loss_positions=m.max_len // mesh[SEQUENCE] // chunk_count(
                  m.max_len, chunk_positions(m.loss_chunk, batch, mesh[SEQUENCE])),
              mlp_chunks=chunk_count(m.max_len, chunk_positions(m.mlp_chunk, batch, mesh[SEQUENCE])) if m.mlp_chunk else 1)


def memory(config, mesh: dict, weights: list[Weight]) -> dict[str, int]:
  """Per-device bytes: params, gradients, optimizer state, batch, saved activations."""
  zero, axis, d = config.sharding.zero, rules.fsdp_axis(config.sharding), dims(config, mesh)
  params = sum(shard_elements(w, mesh, rules.weight_rules(zero, axis)) for w in weights) * MASTER_BYTES
  moments = sum(shard_elements(w, mesh, rules.optimizer_rules(zero, axis)) * state
                for w, state in zip(weights, optimizer_state_bytes(config, weights)))
  local_batch = config.batch_size // (mesh[DATA] * mesh[EXPERT])
  # Accumulating micro-batches holds the running sum beside each micro-batch's gradients.
  return {"params": params, "grads": params * (2 if config.grad_accum > 1 else 1),
          "opt_state": moments,
          "batch": 2 * local_batch * d.length * INT32_BYTES,
          "activations": activations(config, d, weights)}


# The planner asks the same optimizer of the same weights on thousands of layouts.
_STATE_BYTES = {}


def optimizer_state_bytes(config, weights: list[Weight]) -> list[int]:
  """training/optimizer.py `state_bytes`: what the optimizer keeps per element of each weight, read off its
  abstract state once per optimizer, moments' dtype and model."""
  key = (config.optimizer.name, config.precision.moments, tuple(weights))
  if key not in _STATE_BYTES:
    _STATE_BYTES[key] = optimizer.state_bytes(config, weights)
  return _STATE_BYTES[key]


def saved_per_layer(config, mesh: dict) -> dict[str, int]:
  """Bytes one layer keeps for its backward pass per micro-batch under model.remat: on the device, and
  in pinned host memory (the offloading policies), as jax's autodiff saves them for the model's block."""
  d = dims(config, mesh)
  layer = _layer(config, d, config.model.remat)
  return {"device": layer.saved_bytes(d), "host": layer.saved_bytes(d, host=True)}


@dataclasses.dataclass(frozen=True)
class Residual:
  """A value of one layer as jax traced it on a probe: `bytes` per sequence (if `per_sequence`) and per
  position, or per query and key position (`positions` 0, 1 or 2), with the dimensions `tensor` splits
  divided out and listed: those that grow with the heads (query or key/value) and with the MLP's width."""
  bytes: int
  per_sequence: bool
  positions: int
  heads: tuple[int, ...]
  mlp: tuple[int, ...]
  host: bool  # offloaded to pinned host memory by the remat policy

  def on_device(self, d: Dims) -> int:
    """Bytes on one device for one micro-batch of the run."""
    per_position = (1, d.length, d.length * d.keys)[self.positions]
    return (self.bytes * math.prod(n // d.mesh[TENSOR] for n in self.heads + self.mlp)
            * (d.batch if self.per_sequence else 1) * per_position)


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer as jax's autodiff sees it: what it saves for the backward pass, and the activations its
  matmuls read or write."""
  saved: tuple[Residual, ...]
  matmul_activations: tuple[Residual, ...]

  def saved_bytes(self, d: Dims, per_sequence: bool | None = None, host: bool = False) -> int:
    """What it saves on one device, or in host memory; `per_sequence` True or False: only what does or
    does not grow with the micro-batch (the latter: the weights' casts to the compute dtype)."""
    return sum(r.on_device(d) for r in self.saved if r.host == host and per_sequence in (None, r.per_sequence))


PROBE_POSITIONS = 8  # blockwise attention runs the probe as two blocks, a chunked MLP as two chunks
# The probe's second trace grows each thing a layer's values may grow with by its own prime, so by how much
# a value grows says with what (the heads grow the embedding's width with them: head_dim stays).
GROWTH = {"positions": 2, "sequences": 3, "layers": 5, "heads": 7, "mlp": 11}


def _layer(config, d: Dims, remat: str, chunked: bool = True, recomputed: bool = False) -> Layer:
  """The run's layer under a remat policy: one dense block of the model (MoE's dispatch is not modelled)
  on the attention path (one block, or blockwise) and the MLP chunking (unless not `chunked`) the run takes.

  `recomputed`: as its backward pass holds it when the whole layer is recomputed. Then the activation's
  intermediates are there whether or not model.recompute_activation keeps them out of the saved values:
  they are made again, inside the same backward pass (the 1B Llama's compiled step at 80 GB,
  `tools/longest_context.py --compile`, reads the same peak with and without).

  Traced on a probe sequence with no placement, plain local math: the Residuals scale to
  the run's micro-batch, positions and tensor shards, so one trace serves every length and layout.
  """
  return _traced_layer(dataclasses.replace(
      model_config(config), num_layers=1, num_experts=0, max_len=PROBE_POSITIONS, remat=remat, attention="xla",
      attention_block=PROBE_POSITIONS // 2 if d.blockwise else 2 * PROBE_POSITIONS,
      mlp_chunk=PROBE_POSITIONS // 2 if chunked and d.mlp_chunks > 1 else 0, loss_chunk=PROBE_POSITIONS,
      document_end=-1, gathered_lookup=False, **({"recompute_activation": False} if recomputed else {})))


@functools.lru_cache(maxsize=None)
def _traced_layer(cfg: ModelConfig) -> Layer:
  """The layer of `cfg`, traced on it and on GROWTH's probe.

  A saved value that does not grow with the layers is hoisted out of the scanned
  loop by jax (the positions' rotary tables, constants) and kept once, not per
  layer: it is left out. A dimension that grows with the heads or the MLP's width
  is split by `tensor` (one as wide as the embedding is taken for the embedding's).
  """
  grown = dataclasses.replace(cfg, **{field: GROWTH[name] * getattr(cfg, field) for name, fields in (
      ("positions", ("max_len",)), ("layers", ("num_layers",)), ("heads", ("num_heads", "kv_heads", "embed_dim")),
      ("mlp", ("mlp_dim",))) for field in fields})
  (saved, matmuls), (grown_saved, grown_matmuls) = _autodiff_avals(cfg, rows=1), _autodiff_avals(
      grown, rows=GROWTH["sequences"])
  if len(saved) != len(grown_saved) or len(matmuls) != len(grown_matmuls):
    raise ValueError(f"The {cfg.family} block keeps different values at different sizes: the memory estimate "
                     "cannot scale them.")
  per_layer = tuple(r for r, grew in (_residual(cfg, *pair) for pair in zip(saved, grown_saved)) if grew["layers"])
  return Layer(per_layer, tuple(_residual(cfg, *pair)[0] for pair in zip(matmuls, grown_matmuls)))


def _residual(cfg: ModelConfig, small, large) -> tuple[Residual, dict[str, int]]:
  """A value as traced on `cfg` and on GROWTH's probe, and how many times it grew with each of GROWTH."""
  grew = {name: _multiplicity(large.size // small.size, prime) for name, prime in GROWTH.items()}
  heads = tuple(n for n, m in zip(small.shape, large.shape) if m == GROWTH["heads"] * n and n != cfg.embed_dim)
  mlp = tuple(n for n, m in zip(small.shape, large.shape) if m == GROWTH["mlp"] * n)
  unit = small.size * small.dtype.itemsize // (cfg.max_len ** grew["positions"] * math.prod(heads + mlp))
  host = getattr(small, "memory_space", None) == jax.memory.Space.Host
  return Residual(unit, bool(grew["sequences"]), grew["positions"], heads, mlp, host), grew


def _multiplicity(n: int, prime: int) -> int:
  """How many times `prime` divides n."""
  return 0 if n % prime else 1 + _multiplicity(n // prime, prime)


def _autodiff_avals(cfg: ModelConfig, rows: int) -> tuple[list, list]:
  """(saved, matmul activations) of cfg's stacked blocks run as the model runs them (scan_blocks, remat
  policy and all) on `rows` sequences: the values jax's autodiff keeps for the backward pass, the weights
  themselves left out (they are the parameters), and every distinct operand and result of the forward's matmuls."""
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg, 0)).blocks)
  run = lambda params, x: scan_blocks(nnx.merge(graphdef, params), x, jnp.arange(cfg.max_len), cfg)[0]
  x = jax.ShapeDtypeStruct((rows, cfg.max_len, cfg.embed_dim), cfg.dtype)
  closed, (_, pullback) = jax.make_jaxpr(lambda *args: jax.vjp(run, *args), return_shape=True)(params, x)
  outvars, arguments = closed.jaxpr.outvars, set(closed.jaxpr.invars)
  saved = [v.aval for v in outvars[len(outvars) - len(jax.tree.leaves(pullback)):]
           if not isinstance(v, jax_core.Literal) and v not in arguments]
  return saved, list(_matmul_values(closed.jaxpr).values())


def _matmul_values(jaxpr) -> dict:
  """{variable: aval} of every dot_general's operands and results, nested jaxprs included, in trace order."""
  found = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.update((v, v.aval) for v in (*eqn.invars, *eqn.outvars) if not isinstance(v, jax_core.Literal))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, (jax_core.Jaxpr, jax_core.ClosedJaxpr)):
          found.update(_matmul_values(getattr(sub, "jaxpr", sub)))
  return found


def _recomputed_layer_bytes(config, d: Dims) -> int:
  """One layer's residuals as its backward pass holds them, recomputed under any remat policy: a chunked
  MLP's (model.mlp_chunk) one chunk at a time, and blockwise attention's output in float32.

  The float32 output corrects the residuals jax lists: blockwise attention
  accumulates its output in float32 (merge_blocks) and casts it after the last
  key block, and jax lists the cast twice, as the flash kernel's residual and by
  its ATTENTION_OUT name. XLA keeps one buffer for the two names, and the
  recomputed forward's float32 output beside the backward's float32 query
  gradient (the 1B Llama's compiled step, `tools/longest_context.py --compile`).
  """
  whole = _layer(config, d, "none", chunked=False, recomputed=True)
  chunked = _layer(config, d, "none", recomputed=True)
  per_chunk = (whole.saved_bytes(d, per_sequence=True) - chunked.saved_bytes(d, per_sequence=True)) // d.mlp_chunks
  casts = whole.saved_bytes(d, per_sequence=False) - chunked.saved_bytes(d, per_sequence=False)
  float32_output = d.tokens * d.heads * d.head_dim * (F32_BYTES - d.compute_bytes) if d.blockwise else 0
  return chunked.saved_bytes(d) + per_chunk + casts + float32_output


def _mlp_gradient_bytes(config, d: Dims) -> int:
  """The MLP's hidden gradients its backward pass makes, one chunk's: one for each hidden activation a
  matmul reads or writes (GELU's input and output; SwiGLU's gate, up projection and their product)."""
  hidden = _layer(config, d, "none", chunked=False, recomputed=True).matmul_activations
  return sum(r.on_device(d) for r in hidden if r.per_sequence and r.mlp) // d.mlp_chunks


def _compute_bytes(config) -> int:
  """Bytes per activation value: float8 multiplies in fp8 but keeps its activations in bfloat16."""
  return np.dtype(model_config(config).dtype).itemsize


def _held_layers(config, mesh: dict) -> tuple[int, int]:
  """(copies, layers): how many micro-batches' residuals a device holds at once, each for this many
  layers. One without a pipeline; 1F1B's stash slots; GPipe's and the interleaved schedule's every
  tick of the stage loop, each for the layers of one virtual stage."""
  layers, stages = config.model.num_layers // mesh[PIPELINE], mesh[PIPELINE]
  if stages == 1:
    return 1, layers
  p, virtual = config.pipeline, schedules.virtual_stages(config.pipeline)
  return schedules.SCHEDULES[p.schedule].held(stages=stages, micro=p.microbatches, virtual=virtual), layers // virtual


def host_memory(config, mesh: dict) -> int:
  """Per-device bytes the remat policy parks in pinned host memory: each layer's offloaded values,
  for every micro-batch whose residuals are held at once (as `activations` counts them on the device)."""
  copies, layers = _held_layers(config, mesh)
  return copies * layers * saved_per_layer(config, mesh)["host"]


def _loss_bytes(d: Dims) -> int:
  """The head and loss running backward over one chunk: the chunk's logits in the compute dtype twice
  (the head's output and its gradient: float32 exists only inside the loss's reductions), the head
  input's gradient, and the head weight's float32 gradient for the chunk beside the running sum
  (counted in `grads`)."""
  logits = d.batch * d.loss_positions * d.vocab * 2 * d.compute_bytes
  return logits + d.activation_bytes(d.embed) + d.embed * d.vocab * F32_BYTES


def activations(config, d: Dims, weights: list[Weight]) -> int:
  """Activations saved for the backward pass, and the larger of one layer's backward working set and the loss's.

  What each layer saves is what jax's autodiff saves for the model's block
  under the remat policy (`saved_per_layer`). The loss runs backward before
  any layer does, so its chunk's logits are gone by the time a layer's working
  set is live. A layer's backward pass holds what the layer saved (recomputed,
  under remat) and the gradients it makes: while its MLP runs backward, the
  MLP's hidden gradients; while its attention runs backward, the query
  gradient in float32 beside the output's gradient, the residual stream's
  gradient in float32 going in and coming out, and for blockwise attention
  one block pair's scores and the keys' and values' float32 gradients (the
  flash kernel's own buffers, model/attention.py `_block_gradients`, and the
  context strategy's, parallel/context.py, which the block's trace does not
  see). Checked against the compiled program (`tools/longest_context.py
  --compile`: the 1B Llama at the lengths the longest-context table gives, and
  `tools/context_memory.py --estimate`).
  """
  mesh, layers, f32 = d.mesh, config.model.num_layers // d.mesh[PIPELINE], F32_BYTES
  loss = _loss_bytes(d)
  residuals = _recomputed_layer_bytes(config, d)
  mlp = residuals + _mlp_gradient_bytes(config, d)
  attention = residuals + d.tokens * (d.heads * d.head_dim * (f32 + d.compute_bytes) + 2 * d.embed * f32)
  kv = d.batch * d.keys * d.kv_heads * d.head_dim  # elements of the keys (or the values) the queries attend to
  if d.blockwise:
    blocks = largest_divisor(d.length, d.attention_block) * largest_divisor(d.keys, d.attention_block)
    # One block pair's float32 scores, probabilities and their two gradients, and the keys' and values'
    # float32 gradients, which the backward pass accumulates over every query block.
    attention += 4 * d.batch * blocks * d.heads * f32 + 2 * kv * f32
  if d.context in context.STRATEGIES:
    attention += context.STRATEGIES[d.context].held(d)
  working = max(mlp, attention)
  layer, (copies, held) = _layer(config, d, config.model.remat), _held_layers(config, mesh)
  saved = layer.saved_bytes(d)
  if mesh[PIPELINE] == 1:
    return held * saved + max(working, loss)
  stages, micro = mesh[PIPELINE], config.pipeline.microbatches
  if schedules.SCHEDULES[config.pipeline.schedule].stashes:
    # The head runs on 1/P of each micro-batch's tokens, as one row chunked by model.loss_chunk.
    tokens = d.batch * d.length // stages
    chunk = tokens // chunk_count(tokens, chunk_positions(config.model.loss_chunk, d.batch, 1))
    # Every micro-batch's chunk of logits stays, in the compute dtype, until its backward tick (the loss
    # reads them in float32 only inside its reductions).
    loss = chunk * d.vocab * d.compute_bytes + d.activation_bytes(d.embed) // stages
    # Each stashed micro-batch's residuals; what a layer saves whatever the micro-batch (the weights'
    # casts to the compute dtype), once.
    kept = layers * layer.saved_bytes(d, per_sequence=False)
    return copies * (held * saved - kept) + kept + working + micro * loss
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


def collectives(config, mesh: dict, weights: list[Weight]) -> dict[tuple[str, str], int]:
  """Ring bytes one device sends per step, by (kind, axes)."""
  traffic = collections.Counter()
  for part in collectives_by_source(config, mesh, weights).values():
    traffic.update(part)
  return dict(traffic)


def collectives_by_source(config, mesh: dict, weights: list[Weight]) -> dict[str, dict[tuple[str, str], int]]:
  """collectives' bytes by what sends them: "gradients" (data parallelism and ZeRO), "tensor",
  "pipeline", "context" (the `sequence` axis) and "experts"; a step-time model overlaps each its own way."""
  out = {}
  for source, count in (("gradients", lambda t: _gradients(config, mesh, weights, t)),
                        ("tensor", lambda t: _tensor_parallel(config, mesh, t)),
                        ("pipeline", lambda t: _pipeline(config, mesh, t)),
                        ("context", lambda t: _context(config, mesh, t)),
                        ("experts", lambda t: _experts(config, mesh, t)),
                        ("optimizer", lambda t: t.update(_optimizer(config).sent(*_optimizer_costs(config, mesh, weights))))):
    traffic = collections.Counter()
    count(traffic)
    out[source] = {key: value for key, value in traffic.items() if value}
  return out


def _gradients(config, mesh, weights, traffic):
  """Data parallelism and ZeRO: gradients summed over every axis that splits the tokens.

  ZeRO-0 all-reduces each gradient. With ZeRO-1/3 a weight whose moments live
  on `data` (hybrid sharding: its groups on `expert`) has its gradient reduce-scattered there (the other token axes
  all-reduce the shard); ZeRO-1 then all-gathers the updated weights (and schedule-free's z), ZeRO-3
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
    # ZeRO splits a weight over its axis only where the weight's own layout does not already (hybrid
    # sharding's groups on `expert` hold a MoE model's experts whole, one set per device, as experts do).
    zero_splits = lambda table: axis in sharded_over(w, mesh, table) - sharded_over(w, mesh, rules.weight_rules(0))
    fsdp = zero == 3 and zero_splits(rules.weight_rules(3, axis))
    scatter = axis in token_axes and zero_splits(rules.optimizer_rules(zero, axis))
    uses = 2 if tied and w.axes == ("vocab", "embed") and not (scatter or pipelined) else 1
    # An expert weight lives on its experts' devices: its gradient is summed over the other token axes.
    # Under a pipeline the weights outside the stages are also summed over `pipeline`.
    replicas = ((token_axes - sharded_over(w, mesh, rules.weight_rules(0)) - ({axis} if scatter else set()))
                | ({PIPELINE} if pipelined and not w.stacked else set()))
    grad = used
    if scatter:
      traffic[("reduce-scatter", axis)] += accum * uses * gather(used, mesh[axis])
      grad //= mesh[axis]
    if replicas:
      group = math.prod(mesh[a] for a in replicas)
      traffic[("all-reduce", axes_key(replicas))] += accum * uses * all_reduce(grad, group)
    if scatter and zero == 1:
      # The updated weights, and what else the optimizer gathers beside them (training/optimizer.py).
      gathers = _optimizer(config).gathered
      traffic[("all-gather", axis)] += gathers * gather(used, mesh[axis])
    if fsdp:
      gathered = used // param_bytes * _gathered_bytes(config, w, weights)
      traffic[("all-gather", axis)] += accum * (2 if w.stacked and not pipelined else 1) * gather(gathered, mesh[axis])


def _optimizer(config) -> optimizer.Optimizer:
  return optimizer.OPTIMIZERS[config.optimizer.name]


def _optimizer_costs(config, mesh, weights) -> tuple:
  """The arguments of the optimizer's costs (training/optimizer.py Optimizer)."""
  return config.optimizer, rules.optimizer_rules(config.sharding.zero, rules.fsdp_axis(config.sharding)), mesh, weights


def optimizer_flops(config, mesh, weights) -> int:
  """The update's matmul FLOPs per device per step (Muon's Newton-Schulz iterations)."""
  return _optimizer(config).flops(*_optimizer_costs(config, mesh, weights))


def _gathered_bytes(config, w: Weight, weights: list[Weight]) -> int:
  """Bytes per element ZeRO-3 gathers a weight in: the partitioner gathers after the cast where it is used.

  The layers' matrices and the head (GPT-2's tied table: gathered once, cast for the logits; its
  lookup reads the table's local columns) multiply in the compute dtype; norms, biases and the
  position table are gathered as float32 (norms compute in float32; biases are a few KiB).
  """
  multiplied = (w.stacked and _is_matrix(w)) or w in _head(config, weights)
  return _compute_bytes(config) if multiplied else MASTER_BYTES


def layer_passes(config, mesh) -> tuple[int, int]:
  """(forward, backward) runs of one device's layers per step, counted in micro-batches.

  Recomputation (a remat policy) runs the forward again.
  """
  # A pipeline stage runs each micro-batch once; its idle ticks are skipped (lax.cond), except under ring
  # attention, whose hops every device runs together: there a stage computes on every tick of its slots.
  forward = schedules.micro_batches(config, mesh[PIPELINE])
  if mesh[PIPELINE] > 1 and mesh[SEQUENCE] > 1 and context.visiting(config.attention.context):
    p = config.pipeline
    ((ticks, busy),) = schedules.busy_slots(p.schedule, stages=mesh[PIPELINE], micro=p.microbatches,
                                            virtual=schedules.virtual_stages(p)).items()
    forward = forward * ticks // busy
  backward = forward
  return forward * (2 if config.model.remat in ("full", "full_offload") else 1), backward


def _tensor_parallel(config, mesh, traffic):
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
  d, t = dims(config, mesh), mesh[TENSOR]
  forward, backward = layer_passes(config, mesh)
  layers = config.model.num_layers // mesh[PIPELINE]
  tokens = all_reduce(d.activation_bytes(d.embed), t)
  per_stage = layers * 2 * tokens  # the attention's and the MLP's output, and their inputs' gradients
  if config.moe.experts:
    # A MoE layer's experts sum their slots (E x capacity rows per sequence, _experts'), not its tokens.
    m = config.moe
    capacity = moe.slots(d.full_length, m.experts, m.top_k, m.capacity_factor, m.dropless)
    slots = all_reduce(m.experts * d.batch * capacity * d.embed * d.compute_bytes, t)
    per_stage += layers // m.every * (slots - tokens)
  outside = (d.activation_bytes(d.embed)
             + (d.tokens * 4 * F32_BYTES + d.activation_bytes(d.embed)) // mesh[PIPELINE])
  micro = schedules.micro_batches(config, mesh[PIPELINE])
  traffic[("all-reduce", TENSOR)] += (forward + backward) * per_stage + micro * all_reduce(outside, t)


def _pipeline(config, mesh, traffic):
  """Stage-to-stage hand-offs of one micro-batch's activations, and the head's rows, as the schedule sends
  them (parallel/schedules.py) for each accumulated micro-batch. (The gradients' reduction is `_gradients`'.)"""
  stages = mesh[PIPELINE]
  if stages == 1:
    return
  d, p = dims(config, mesh), config.pipeline
  sent = schedules.SCHEDULES[p.schedule].sent(d.activation_bytes(d.embed), stages=stages, micro=p.microbatches,
                                             virtual=schedules.virtual_stages(p))
  for key, value in sent.items():
    traffic[key] += config.grad_accum * value


def _context(config, mesh, traffic):
  """Attention over a sharded `length`: per layer, forward and backward, as its strategy sends it
  (parallel/context.py)."""
  shards = mesh[SEQUENCE]
  if shards == 1:
    return
  d = dims(config, mesh)
  forward, backward = layer_passes(config, mesh)
  layers = config.model.num_layers // mesh[PIPELINE]  # a pipeline stage's
  for key, (in_forward, in_backward) in context.STRATEGIES[config.attention.context].sent(d, shards).items():
    traffic[key] += layers * (forward * in_forward + backward * in_backward)
  if mesh[PIPELINE] > 1 and config.moe.experts:
    # In a pipeline stage a MoE layer routes the whole sequence, gathered over `sequence` (parallel/context.py
    # whole_length), and its input's gradient is reduce-scattered back.
    whole = layers // config.moe.every * gather(d.activation_bytes(d.embed) * shards, shards)
    traffic[("all-gather", SEQUENCE)] += forward * whole
    traffic[("reduce-scatter", SEQUENCE)] += backward * whole


def _experts(config, mesh, traffic):
  """Expert parallelism (parallel/experts.py): per MoE layer and pass, each device's (E, batch, capacity,
  embed) slots, in the compute dtype, sent to their experts and back; capacity per sequence as model/moe.py
  sizes it."""
  if mesh[EXPERT] == 1 or not config.moe.experts:
    return
  d, m = dims(config, mesh), config.moe
  forward, backward = layer_passes(config, mesh)
  layers = config.model.num_layers // m.every // mesh[PIPELINE]
  capacity = moe.slots(d.full_length, m.experts, m.top_k, m.capacity_factor, m.dropless)
  tokens = m.experts * d.batch * capacity * d.embed * d.compute_bytes
  for key, value in experts.sent(tokens, mesh[EXPERT]).items():
    traffic[key] += (forward + backward) * layers * value


def _is_matrix(w: Weight) -> bool:
  """A weight the tokens multiply: an `embed` axis and another beside `layers` and `expert` (not a bias or norm)."""
  return "embed" in w.axes and any(a not in ("embed", "layers", "expert") for a in w.axes)


def _head(config, weights) -> list[Weight]:
  """The logits' weight: GPT-2's tied token table (vocab, embed), Llama's (embed, vocab) head; a lookup is no matmul."""
  axes = ("vocab", "embed") if FAMILIES[config.model.family].tied_head else ("embed", "vocab")
  return [w for w in weights if w.axes == axes]


def stage_forward(config, d: Dims, mesh, weights) -> dict[str, int]:
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
  attention = context.scored_flops(d.context, attention, mesh[SEQUENCE])
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
  _, runs = layer_passes(config, mesh)  # micro-batches each layer runs forward and backward
  parts = stage_forward(config, d, mesh, weights)
  forward = sum(v for k, v in parts.items() if k not in _PARTS_OF_DENSE)
  recompute = _recomputed(config, parts)
  if context.visiting(d.context):  # its backward recomputes every visited block's QK^T from the log-sum-exp, as flash does
    recompute += parts["scores"]
  head_tokens = config.batch_size // (mesh[DATA] * mesh[EXPERT]) * d.length // mesh[PIPELINE]
  head = 3 * 2 * head_tokens * sum(shard_elements(w, mesh, rules.weight_rules(0)) for w in _head(config, weights))
  out = {"layers": runs * 3 * forward, "head": head, "recompute": runs * recompute,
         "optimizer": optimizer_flops(config, mesh, weights)}
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
