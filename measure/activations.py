"""What a train step keeps for its backward pass, per device: each layer's saved values, its backward
working set and the loss's, and what the offloading remat policies park in host memory.

What a layer saves for its backward pass is what jax's autodiff saves when it
traces the model's own block under the remat policy, so the estimate cannot
drift from the model; its size per device scales with the run's micro-batch,
positions and tensor shards. The context strategies' own buffers come from
their entries in parallel/context.py.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jax_core

from measure.sizes import dims, held_layers, run_of, stage_elements, stage_layers, stage_units
from model.attention import largest_divisor
from model.config import ModelConfig
from model.stack import scan_blocks
from model.transformer import chunk_count, chunk_positions
from parallel import context, schedules
from parallel.costs import F32_BYTES, MASTER_BYTES, Dims, Weight
from parallel.mesh import PIPELINE, TENSOR
from training.state import build_model


def saved_per_layer(run, mesh: dict) -> dict[str, int]:
  """Bytes one layer keeps for its backward pass per micro-batch under model.remat: on the device, and
  in pinned host memory (the offloading policies), as jax's autodiff saves them for the model's block."""
  run = run_of(run)
  d = dims(run, mesh)
  layer = _layer(run, d, run.model.remat)
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


def _layer(run, d: Dims, remat: str, chunked: bool = True, recomputed: bool = False) -> Layer:
  """The run's layer under a remat policy: one dense block of the model (MoE's dispatch is not modelled; a window
  saves what a global layer does)
  on the attention path (one block, or blockwise) and the MLP chunking (unless not `chunked`) the run takes.

  `recomputed`: as its backward pass holds it when the whole layer is recomputed. Then the activation's
  intermediates are there whether or not model.recompute_activation keeps them out of the saved values:
  they are made again, inside the same backward pass (the 1B Llama's compiled step at 80 GB,
  `tools/longest_context.py --compile`, reads the same peak with and without).

  Traced on a probe sequence with no placement, plain local math: the Residuals scale to
  the run's micro-batch, positions and tensor shards, so one trace serves every length and layout.
  """
  return _traced_layer(_probe_config(run.model, remat, d.blockwise, chunked and d.mlp_chunks > 1, recomputed))


@functools.lru_cache(maxsize=None)
def _probe_config(model: ModelConfig, remat: str, blockwise: bool, chunked_mlp: bool, recomputed: bool) -> ModelConfig:
  """The model of _layer's probe. Cached: the planner asks for it hundreds of thousands of times, and each
  dataclasses.replace runs ModelConfig's checks again."""
  return dataclasses.replace(
      model, num_layers=1, num_experts=0, moe_first_dense=0, moe_dense_width=0, global_every=0, local_rope_theta=0.0,
      mtp_depth=0, unet_skips=False, value_embeds=0, max_len=PROBE_POSITIONS, remat=remat, attention="xla",
      attention_block=PROBE_POSITIONS // 2 if blockwise else 2 * PROBE_POSITIONS,
      mlp_chunk=PROBE_POSITIONS // 2 if chunked_mlp else 0, loss_chunk=PROBE_POSITIONS,
      document_end=-1, gathered_lookup=False, **({"recompute_activation": False} if recomputed else {}))


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


def _recomputed_layer_bytes(run, d: Dims) -> int:
  """One layer's residuals as its backward pass holds them, recomputed under any remat policy: a chunked
  MLP's (model.mlp_chunk) one chunk at a time, and blockwise attention's output in float32.

  The float32 output corrects the residuals jax lists: blockwise attention
  accumulates its output in float32 (merge_blocks) and casts it after the last
  key block, and jax lists the cast twice, as the flash kernel's residual and by
  its ATTENTION_OUT name. XLA keeps one buffer for the two names, and the
  recomputed forward's float32 output beside the backward's float32 query
  gradient (the 1B Llama's compiled step, `tools/longest_context.py --compile`).
  """
  whole = _layer(run, d, "none", chunked=False, recomputed=True)
  chunked = _layer(run, d, "none", recomputed=True)
  per_chunk = (whole.saved_bytes(d, per_sequence=True) - chunked.saved_bytes(d, per_sequence=True)) // d.mlp_chunks
  casts = whole.saved_bytes(d, per_sequence=False) - chunked.saved_bytes(d, per_sequence=False)
  float32_output = d.tokens * d.heads * d.head_dim * (F32_BYTES - d.compute_bytes) if d.blockwise else 0
  return chunked.saved_bytes(d) + per_chunk + casts + float32_output


def _mlp_gradient_bytes(run, d: Dims) -> int:
  """The MLP's hidden gradients its backward pass makes, one chunk's: one for each hidden activation a
  matmul reads or writes (GELU's input and output; SwiGLU's gate, up projection and their product)."""
  hidden = _layer(run, d, "none", chunked=False, recomputed=True).matmul_activations
  return sum(r.on_device(d) for r in hidden if r.per_sequence and r.mlp) // d.mlp_chunks


def host_memory(run, mesh: dict) -> int:
  """Per-device bytes the remat policy parks in pinned host memory: each layer's offloaded values,
  for every micro-batch whose residuals are held at once (as `activations` counts them on the device)."""
  run = run_of(run)
  copies, layers = held_layers(run, mesh)
  return copies * layers * saved_per_layer(run, mesh)["host"]


def _loss_bytes(d: Dims) -> int:
  """The head and loss running backward over one chunk: the chunk's logits in the compute dtype twice
  (the head's output and its gradient: float32 exists only inside the loss's reductions), the head
  input's gradient, and the head weight's float32 gradient for the chunk beside the running sum
  (counted in `grads`)."""
  logits = d.batch * d.loss_positions * d.vocab * 2 * d.compute_bytes
  return logits + d.activation_bytes(d.embed) + d.embed * d.vocab * F32_BYTES


def activations(run, d: Dims, weights: list[Weight]) -> int:
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
  run = run_of(run)
  mesh, layers, f32 = d.mesh, stage_layers(run, d.mesh), F32_BYTES
  loss = _loss_bytes(d)
  residuals = _recomputed_layer_bytes(run, d)
  mlp = residuals + _mlp_gradient_bytes(run, d)
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
  layer, (copies, held) = _layer(run, d, run.model.remat), held_layers(run, mesh)
  saved = layer.saved_bytes(d)
  if mesh[PIPELINE] == 1:
    # Each multi-token prediction module (model/mtp.py; refused with a pipeline) saves what a layer does, and its
    # loss keeps the gradients for its input and the head (the custom VJP's residuals, _loss_bytes' last two
    # terms) until the backward pass reaches it.
    modules = run.model.mtp_depth * (saved + d.activation_bytes(d.embed) + d.embed * d.vocab * f32)
    # The U-net's first half keeps each unit's output for the second half (model/unet.py), and the value tables'
    # rows for the tokens wait for their layers (model/value_embeds.py); pipelines refuse both.
    modules += (run.model.unet_skips * run.model.num_units // 2 * d.activation_bytes(d.embed)
                + run.model.value_embeds * d.activation_bytes(d.kv_heads * d.head_dim))
    return held * saved + modules + max(working, loss)
  stages, micro = mesh[PIPELINE], run.pipeline.microbatches
  # Unequal stages gather each device's chunks whole for the step, in float32, and their gradients beside them
  # (parallel/pipeline.py `_stage_view`).
  working += 2 * _stage_weight_bytes(run, mesh, weights) if stage_units(run, mesh) else 0
  if schedules.SCHEDULES[run.pipeline.schedule].stashes:
    # The head runs on 1/P of each micro-batch's tokens, as one row chunked by model.loss_chunk.
    tokens = d.batch * d.length // stages
    chunk = tokens // chunk_count(tokens, chunk_positions(run.model.loss_chunk, d.batch, 1))
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
  chunk = _stage_weight_bytes(run, mesh, weights) * held // layers
  return copies * (held * saved + chunk) + working + loss


def _stage_weight_bytes(run, mesh, weights) -> int:
  """The stacked weights one stage holds, whole over `data`, in the parameter dtype."""
  return sum(stage_elements(run, mesh, w) for w in weights if w.stacked) * MASTER_BYTES
