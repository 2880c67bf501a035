"""Pipeline parallelism over `pipeline`: the stacked layers split into stages, micro-batches flow between them.

The model comes in three parts (embed, stacked blocks, head and loss); only
the blocks are pipelined. The whole step, gradients included, runs in one
`shard_map` manual over `pipeline`, the batch's axes (`expert`, `data`) and
`sequence`, so each device keeps its own rows and its shard of the sequence and
every collective in it is one named here; `tensor` stays under GSPMD, so
Megatron's tensor parallelism composes inside each stage. A sharded sequence
arrives in the order its context strategy wants (zig-zag for the ring), and
the stages run the strategy's attention in this map (placement.for_stages).
Each device differentiates its share of the loss with every weight
marked as differing between devices, so autodiff adds no collective of its
own; the gradients are summed once per step, after the schedule: the stage
weights' over the token axes, the embedding's and head's over `pipeline` too,
and reduce-scattered over the axis ZeRO-3 splits a weight over (which enters
the map gathered, once per step).

- gpipe and interleaved run the circular schedule of parallel/schedules.py;
  activations hop stage to stage with `ppermute`, and autodiff through the
  tick loop gives the backward pass. A stage runs under `lax.cond`, so a bubble
  tick costs no FLOPs forward or backward (autodiff transposes the cond). Every stage looks its rows up in the
  embedding (a gather, no matmul) and the first uses them. After the loop an
  all-to-all scatters the last stage's outputs over the stages, so each
  computes the head and loss for 1/P of the rows (MaxText shards its logits'
  batch over its stage axis the same way).
- 1f1b computes its own gradients: each tick every stage has one forward and
  one backward slot, run under `lax.cond` so idle slots cost nothing, and
  each micro-batch is turned round as it leaves the last stage (head, loss
  and its gradient), every stage running the head on 1/P of its tokens. The
  forward slot stashes the residuals of the stage's `jax.vjp` (what the remat
  policy keeps) and the backward slot applies them, so nothing is recomputed
  beyond the policy; a stage holds at most min(M, 2P - 1) micro-batches'
  residuals. Gradients accumulate inside the slots that make them. The head
  differentiates the loss times float16's loss scale, so the scale reaches
  every gradient through the cotangents the slots pass on.

Unequal stages (pipeline.first_stage_layers and last_stage_layers, parallel/stages.py): the stack enters
split over `pipeline` by its `embed` axis, not by layer, and `_stage_view` gathers each device's chunks
whole by one all-to-all per weight, into slots as long as the longest chunk; a slot beyond a shorter
chunk's layers is skipped under lax.cond, and the all-to-all's transpose returns the gradients.

A mixture-of-experts model pipelines as grad_accum accumulates: each
micro-batch is routed, balanced and dropped on its own, its router figures
(model/moe.py `route`) those of all its rows over the batch's devices (the
placement averages them over the map's manual batch axes), and the step's
objective and figures are the means over the micro-batches of each one's
cross-entropy plus auxiliary losses. A pipeline of M micro-batches therefore
computes what one device computes with grad_accum=M. Each busy tick adds
its stage's auxiliary loss to the objective it differentiates (1F1B hands the
stage's vjp its cotangent with the output's); the experts exchange their
tokens inside the stage (parallel/experts.py `exchange`), the expert weights
entering the map split over `expert`.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.moe import AUX_LOSS, LOADS
from model.placement import placed
from model.transformer import STACKED, packed_documents
from parallel import context, jax_compat, microbatch, placement, schedules, stages as stage_split
from parallel.layout import Layout
from parallel.mesh import PIPELINE, SEQUENCE
from parallel.rules import BATCH_AXES, as_entry, entry_axes

TOKEN_AXES = (*BATCH_AXES, SEQUENCE)  # what splits a batch's tokens: its rows, and along them the sequence
MANUAL = (PIPELINE, *TOKEN_AXES)


def loss_and_grads(layout: Layout, params, batch, scale=None):
  """((objective, statistics), gradients of `scale` x objective) under the layout's schedule, each gradient laid
  out as its optimizer moments: training/step.py's objective and statistics, each the mean over the
  micro-batches. Under ZeRO-1 as under ZeRO-3 a gradient leaves the stages reduce-scattered over `data`
  (hybrid sharding: its groups), each device keeping the share its optimizer updates, as Megatron-LM's
  distributed optimizer does; summed whole, it would cross the links twice."""
  grad_specs = jax.tree.map(_manual, layout.moment_shardings)
  # A schedule that stashes each micro-batch's residuals runs its own backward (1F1B); the others run
  # the circular forward that autodiff differentiates.
  schedule = _one_f_one_b if schedules.SCHEDULES[layout.schedule].stashes else _circular
  virtual = layout.virtual_stages
  stages = layout.mesh.shape[PIPELINE]

  def body(params, tokens, scale):
    if layout.stage_units is not None:  # unequal stages: gather this device's chunks from the stack's `embed` split
      blocks, to_stored = jax.vjp(lambda stored: _stage_view(layout, weight_specs[STACKED], stored),
                                  jax.tree.map(_varying, params[STACKED]))
      params = {**params, STACKED: blocks}
    with placed(placement.for_stages(layout)):
      cross_entropy, figures, grads = schedule(layout, jax.tree.map(_varying, params), tokens, scale)
    if layout.stage_units is not None:
      grads = {**grads, STACKED: to_stored(grads[STACKED])[0]}
    cross_entropy, figures = jax.lax.psum((cross_entropy, figures), MANUAL)
    chunk_units = jax.tree.leaves(params[STACKED])[0].shape[0] // virtual
    stats = {"cross_entropy": cross_entropy,
             **_step_figures(figures, layout.microbatches, layout.model.num_units / chunk_units)}
    return (cross_entropy + stats.get(AUX_LOSS, 0.0), stats), jax.tree.map(_reduce, grads, grad_specs, weight_specs)

  # Weights enter as the step uses them, without ZeRO's split (ZeRO-3 gathers them here, once per step, over
  # `data` or hybrid sharding's groups): split over `pipeline` (the stage weights) and over `expert` (a MoE
  # model's expert weights: each device runs its own experts).
  weight_specs = jax.tree.map(_manual, layout.used_shardings)
  if layout.stage_units is None:
    params = {**params, STACKED: _stage_major(params[STACKED], virtual, stages)}
  scale = jnp.ones((), jnp.float32) if scale is None else scale
  tokens = _tokens(layout, batch)
  # A token's row splits over the batch's axes and its place in the sequence over `sequence`.
  token_specs = jax.tree.map(lambda x: P(BATCH_AXES, SEQUENCE) if x.ndim == 2 else P(SEQUENCE), tokens)
  loss_stats, grads = jax.shard_map(
      body, mesh=layout.mesh, in_specs=(weight_specs, token_specs, P()),
      out_specs=(P(), grad_specs), axis_names=set(MANUAL))(params, tokens, scale)
  if layout.stage_units is None:
    grads = {**grads, STACKED: _stage_major(grads[STACKED], stages, virtual)}
  return loss_stats, grads


def _tokens(layout: Layout, batch) -> dict:
  """What the stages read of the batch, in the order the context strategy wants the sequence (zig-zag for
  the ring): inputs, targets, any loss weights, positions, the positions the embedding sees and, packed,
  segment ids."""
  order_T = context.token_order(layout.context, batch["inputs"].shape[1], layout.mesh.shape[SEQUENCE])
  if order_T is not None:
    batch = {name: batch_BT[:, order_T] for name, batch_BT in batch.items()}
  positions_T = jnp.arange(batch["inputs"].shape[1]) if order_T is None else jnp.asarray(order_T)
  segments_BT, embed_positions = packed_documents(batch["inputs"], positions_T, layout.model.document_end)
  tokens = {**batch, "positions": positions_T, "embed_positions": embed_positions}
  return tokens if segments_BT is None else {**tokens, "segments": segments_BT}


def _manual(sharding, axes=MANUAL):
  """The part of a weight's sharding over `axes`; over all the map's manual axes, how its gradient leaves the map."""
  return P(*(as_entry(tuple(a for a in entry_axes(entry) if a in axes)) for entry in sharding.spec))


def _varying(x, axes=MANUAL):
  """`x` marked as differing between devices over `axes`, by default every manual axis (its gradient then
  stays local)."""
  same = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
  return jax.lax.pcast(x, same, to="varying") if same else x


def _reduce(grad, spec, entered):
  """One device's gradient summed over the devices that share its weight: scattered over the axes its
  parameter is split over but the weight entered the map whole over (ZeRO-3's), summed over every other
  manual axis it is not split over."""
  held = {a for entry in entered for a in entry_axes(entry)}
  for dimension, entry in enumerate(spec):
    if scattered := tuple(a for a in entry_axes(entry) if a not in held):
      grad = jax.lax.psum_scatter(grad, scattered, scatter_dimension=dimension, tiled=True)
  split = {a for entry in spec for a in entry_axes(entry)}
  summed = tuple(a for a in MANUAL if a not in split)
  return jax.lax.psum(grad, summed) if summed else grad


def _stage_major(blocks, outer: int, inner: int):
  """Reorder the layer axis as (outer, inner, layers) -> (inner, outer, layers).

  With (V, P) device p's contiguous shard then holds chunks p, p + P, ..., p + (V-1)P; (P, V) undoes it.
  """
  def reorder(w_LX):
    w_OIlX = w_LX.reshape(outer, inner, -1, *w_LX.shape[1:])
    return jnp.swapaxes(w_OIlX, 0, 1).reshape(w_LX.shape)
  return blocks if outer == 1 or inner == 1 else jax.tree.map(reorder, blocks)


def _stage_view(layout: Layout, specs, stored):
  """This device's chunks, [V x slots, ...] (parallel/stages.py), of a stack of unequal stages, which lies
  split over `pipeline` by `embed`: each device picks every device's slots out of its share of `embed`,
  and one all-to-all hands each device its own slots, whole. A weight without an `embed` axis lies whole
  on every device, which picks its own. Autodiff's transpose brings each slot's gradient back to the
  share it came from (the all-to-all reversed, then a scatter-add over the slots)."""
  stages = layout.mesh.shape[PIPELINE]
  units_PS = jnp.asarray(stage_split.slot_units(layout.stage_units, stages).reshape(stages, -1))

  def view(w_LX, spec):
    split = [d for d, entry in enumerate(spec) if PIPELINE in entry_axes(entry)]
    if not split:
      return jnp.take(w_LX, units_PS[jax.lax.axis_index(PIPELINE)], axis=0)
    return jax.lax.all_to_all(jnp.take(w_LX, units_PS.reshape(-1), axis=0), PIPELINE, 0, split[0], tiled=True)

  return jax.tree.map(view, stored, specs)


def _slots(layout: Layout, stage, chunk) -> dict:
  """What run_blocks needs to know of the slots of this stage's `chunk`: which hold units (`live_L`, unequal
  stages only) and which of the model's units they hold (`units_L`, only where the layers differ by place,
  model.global_every, or where each layer's loads move its own router bias, moe.bias_rate)."""
  stages, model = layout.mesh.shape[PIPELINE], layout.model
  units = layout.stage_units or (model.num_units // (stages * layout.virtual_stages),) * stages * layout.virtual_stages
  return {**({"live_L": jnp.asarray(stage_split.live_slots(units, stages))[stage, chunk]}
             if layout.stage_units else {}),
          **({"units_L": jnp.asarray(stage_split.slot_units(units, stages))[stage, chunk]}
             if model.global_every or model.moe_bias_rate else {})}


def _run_stage(layout: Layout, params, blocks, x_bTD, positions_T, segments_bT=None, slots=None):
  """The stage's output and this device's share of its router figures ({} when dense). A figure is the whole
  micro-batch's, the same on each of the stage's token shards, so each holds 1/shards of it: summed over
  the devices like the loss's shares, it counts once. `slots` tells run_blocks which units the stage's slots
  hold (`_slots`). Each layer's loads (moe.bias_rate) come back at their units' places in a [units, experts]
  array, zero elsewhere, so the stages' sum holds every layer's own."""
  model = nnx.merge(layout.graphdef, {**params, STACKED: blocks})
  y_bTD, figures = model.run_blocks(x_bTD, positions_T, segments_bT, **(slots or {}))
  if LOADS in figures:
    loads_SE = figures[LOADS]
    figures[LOADS] = _zeros(jax.ShapeDtypeStruct((layout.model.num_units, loads_SE.shape[-1]), loads_SE.dtype)
                            ).at[slots["units_L"]].add(loads_SE)
  return y_bTD, {key: _varying(value) / _shards(layout) for key, value in figures.items()}


def _step_figures(totals, micro: int, chunks: float):
  """The step's router figures from their sums over every (micro-batch, chunk of layers): a figure is the stack's
  mean over its units (model/moe.py `summarize`) and each chunk's the mean over its slots (an empty slot's
  zero), so `chunks` is the stack's units over a chunk's slots; the auxiliary loss is the sum of the
  chunks', and each layer's loads its own (`_run_stage`); and the step's figure is the mean over
  micro-batches, as grad_accum's."""
  return {key: total / (micro if key in (AUX_LOSS, LOADS) else micro * chunks) for key, total in totals.items()}


def _zeros(tree):
  """Zeros shaped as `tree`'s leaves (arrays or shapes), varying over every manual axis."""
  return jax.tree.map(lambda x: _varying(jnp.zeros(x.shape, x.dtype)), tree)


def _shards(layout: Layout) -> int:
  """Into how many shards the batch's tokens split over the map's devices of one stage."""
  return math.prod(layout.mesh.shape[a] for a in TOKEN_AXES)


def _slot(layout: Layout, valid, busy, idle, *operands):
  """busy(*operands) where `valid`, else idle(*operands): under lax.cond, so an idle slot does no work.

  Except where a stage's attention passes blocks round a ring: one HLO collective-permute serves every
  ring of the mesh at once, so every device must run it together (a device that skips it leaves the
  others waiting forever; XLA's CPU runtime aborts after 40 s). There both run and a select keeps one:
  an idle slot computes on what it holds and throws it away, in a tick that lasts as long as the
  busy stages' anyway.
  """
  if layout.context != "ring":
    return jax.lax.cond(valid, busy, idle, *operands)
  return jax.tree.map(lambda b, i: jnp.where(valid, b, i), busy(*operands), idle(*operands))


def _micro_batches(layout: Layout, tokens, name: str):
  """tokens[name] split into the schedule's micro-batches, [M, b, T]; None where the batch has no such entry."""
  return microbatch.split(tokens[name], layout.microbatches, layout.mesh) if name in tokens else None


def _of_micro_batch(x_MX, m, micro: int):
  """Micro-batch m's slice of x_MX (None stays None); m may be out of range on an idle slot."""
  return None if x_MX is None else x_MX[jnp.clip(m, 0, micro - 1)]


def _circular(layout: Layout, params, tokens, scale):
  """This device's shares of the cross-entropy and of the router figures, and the gradients of its share of the
  objective, the blocks run by the gpipe / interleaved schedule."""
  stages, virtual, micro = layout.mesh.shape[PIPELINE], layout.virtual_stages, layout.microbatches
  ticks = schedules.circular_ticks(stages=stages, virtual=virtual, micro=micro)
  out_ticks = jnp.array([schedules.circular_output_tick(m, stages=stages, virtual=virtual)
                         for m in range(micro)])
  ring = [(p, (p + 1) % stages) for p in range(stages)]
  stage = jax.lax.axis_index(PIPELINE)
  # Rows of this stage's share of the head: 1/P of every device's rows, the same on every stage.
  # (and the loss weights, fine-tuning on completions).
  scored_PrT = {name: _micro_batches(layout, tokens, name).reshape(stages, -1, tokens[name].shape[1])
                for name in ("targets", "weights") if name in tokens}
  segments_MbT = _micro_batches(layout, tokens, "segments")

  def share(params):
    model = nnx.merge(layout.graphdef, params)
    x_MbTD = microbatch.split(model.embed_tokens(tokens["inputs"], tokens["embed_positions"]), micro, layout.mesh)
    chunk_layers = jax.tree.leaves(params[STACKED])[0].shape[0] // virtual

    def tick(incoming_bTD, t):
      m, s, valid = schedules.circular_slot(t, stage, stages=stages, virtual=virtual, micro=micro)
      x_bTD = jnp.where(s == 0, x_MbTD[jnp.clip(m, 0, micro - 1)], incoming_bTD)
      chunk = jax.tree.map(
          lambda w: jax.lax.dynamic_slice_in_dim(w, (s // stages) * chunk_layers, chunk_layers),
          params[STACKED])
      # A bubble tick does no work: the stage runs under lax.cond (`_slot`), and so does its backward pass.
      run = functools.partial(_run_stage, layout, params, chunk, positions_T=tokens["positions"],
                              segments_bT=_of_micro_batch(segments_MbT, m, micro),
                              slots=_slots(layout, stage, s // stages))
      y_bTD, figures = _slot(layout, valid, run, lambda x: _zeros(jax.eval_shape(run, x)), x_bTD)
      return jax.lax.ppermute(y_bTD, PIPELINE, ring), (y_bTD, figures)

    _, (y_tbTD, figures_tX) = jax.lax.scan(tick, _zeros(x_MbTD[0]), jnp.arange(ticks))
    figures = jax.tree.map(lambda f_tX: f_tX.sum(0), figures_tX)
    # The last virtual stage lives on the last device: it sends each stage 1/P of its outputs' rows.
    y_PrTD = y_tbTD[out_ticks].reshape(stages, -1, *x_MbTD.shape[2:])
    y_rTD = jax.lax.all_to_all(y_PrTD, PIPELINE, 0, 0)[stages - 1]
    cross_entropy = model.head_loss(y_rTD, *(s_PrT[stage] for s_PrT in scored_PrT.values())) / (
        stages * _shards(layout))
    # Each busy tick's auxiliary loss, 1/M of it: the objective is the mean over the micro-batches.
    objective = cross_entropy + figures.get(AUX_LOSS, 0.0) / micro
    return scale * objective, (cross_entropy, figures)

  (_, (cross_entropy, figures)), grads = jax.value_and_grad(share, has_aux=True)(params)
  return cross_entropy, figures, grads


def _one_f_one_b(layout: Layout, params, tokens, scale):
  """This device's shares of the cross-entropy and of the router figures, and the gradients of its share of the
  objective, by the 1F1B schedule, which runs the backward itself."""
  stages, micro = layout.mesh.shape[PIPELINE], layout.microbatches
  ticks = schedules.one_f_one_b_ticks(stages=stages, micro=micro)
  slots = schedules.stash_slots(stages=stages, micro=micro)
  forward_pairs = [(p, p + 1) for p in range(stages - 1)]
  backward_pairs = [(p + 1, p) for p in range(stages - 1)]
  split = functools.partial(microbatch.split, count=micro, mesh=layout.mesh)
  stage = jax.lax.axis_index(PIPELINE)
  last = stage == stages - 1
  blocks = params[STACKED]
  shared = {k: v for k, v in params.items() if k != STACKED}  # embedding, head, final norm
  segments_MbT = _micro_batches(layout, tokens, "segments")
  # Micro-batch f through the stage (its packed documents' segments, where there are any).
  run_stage = lambda blocks, x_bTD, f: _run_stage(layout, shared, blocks, x_bTD, tokens["positions"],
                                                   _of_micro_batch(segments_MbT, f, micro), _slots(layout, stage, 0))

  def differentiated(f):
    """The stage on micro-batch f as a function of (blocks, input) -> ((the stage's output, its auxiliary
    loss; None when dense), the figures): the objective differentiates the first two, the rest are only logged."""
    def run(blocks, x_bTD):
      y_bTD, figures = run_stage(blocks, x_bTD, f)
      return (y_bTD, figures.get(AUX_LOSS)), figures
    return run

  def embed(shared):
    model = nnx.merge(layout.graphdef, {**shared, STACKED: blocks})
    return split(model.embed_tokens(tokens["inputs"], tokens["embed_positions"]))

  def head_loss(shared, y_btD, scored_bt):
    loss = nnx.merge(layout.graphdef, {**shared, STACKED: blocks}).head_loss(y_btD, *scored_bt)
    loss = loss / (micro * _shards(layout) * stages)
    return scale * loss, loss

  x_MbTD, embed_vjp = jax.vjp(embed, shared)
  # Every stage runs the head on 1/P of each micro-batch's tokens: this stage's share of the targets (and
  # of the loss weights, fine-tuning on completions).
  scored_MPt = tuple(split(tokens[name]).reshape(micro, stages, 1, -1) for name in ("targets", "weights")
                     if name in tokens)
  idle_bTD, idle_figures = _zeros(jax.eval_shape(run_stage, blocks, x_MbTD[0], 0))
  # The cotangent of the stage's auxiliary loss: the objective adds 1/M of each micro-batch's (the step's is
  # the mean over micro-batches).
  d_aux = jax.tree.map(lambda zero: zero + scale / micro, idle_figures.get(AUX_LOSS))

  # The stage's vjp is a pytree of residual arrays. Those that depend on the micro-batch (its rows'
  # activations; the router's statistics of all its rows) are stashed from the forward slot for the
  # backward slot; the rest (the weights, their casts to the compute dtype, masks) depend on the weights
  # alone, so they are made once here and shared by every slot. Which are which is the traced vjp's data
  # dependence on the stage's input (and the micro-batch's index, which picks its packed documents): the
  # residuals JAX's partial evaluation leaves unknown without them.
  residuals = lambda blocks, x_bTD, f: jax.tree.leaves(jax.vjp(differentiated(f), blocks, x_bTD, has_aux=True)[1])
  per_micro = jax_compat.partial_eval_jaxpr_nounits(
      jax.make_jaxpr(residuals)(blocks, x_MbTD[0], jnp.int32(0)), [False] * len(jax.tree.leaves(blocks)) + [True, True],
      instantiate=False)[2]
  # Traced at a micro-batch index that varies over `pipeline` as the slots' do (they come from the stage's
  # index), so the residuals it picks (packed documents' masks) are typed as the stash's.
  _, weights_vjp, _ = jax.vjp(differentiated(stage * 0), blocks, x_MbTD[0], has_aux=True)
  fixed, treedef = jax.tree.flatten(weights_vjp)

  def forward(x_bTD, stash, f):
    (y_bTD, _), stage_vjp, figures = jax.vjp(differentiated(f), blocks, x_bTD, has_aux=True)
    saved = [r for r, mine in zip(jax.tree.leaves(stage_vjp), per_micro) if mine]
    return y_bTD, figures, [s.at[f % slots].set(r) for s, r in zip(stash, saved)]

  def backward(block_grads, stash, b, d_out_bTD):
    saved = iter([s[b % slots] for s in stash])
    stage_vjp = jax.tree.unflatten(treedef, [next(saved) if mine else r for r, mine in zip(fixed, per_micro)])
    d_blocks, d_x_bTD = stage_vjp((d_out_bTD, d_aux))
    return jax.tree.map(jnp.add, block_grads, d_blocks), d_x_bTD

  def turn_round(loss, shared_grads, y_1tD, scored_1t):
    (_, f_loss), (head_grads, d_y_1tD) = jax.value_and_grad(head_loss, argnums=(0, 1), has_aux=True)(
        shared, y_1tD, scored_1t)
    return loss + f_loss, jax.tree.map(jnp.add, shared_grads, head_grads), d_y_1tD

  def tick(carry, t):
    incoming_bTD, cotangent_bTD, stash, loss, figures, shared_grads, block_grads, d_x_MbTD = carry
    f, f_ok, b, b_ok = schedules.one_f_one_b_slots(t, stage, stages=stages, micro=micro)
    # Each slot runs under lax.cond (`_slot`), so a stage with nothing to do in it does no work, and each
    # adds what it makes to the carry in place. Forward slot: micro-batch f through this stage.
    x_bTD = jnp.where(stage == 0, x_MbTD[jnp.clip(f, 0, micro - 1)], incoming_bTD)
    y_bTD, f_figures, stash = _slot(
        layout, f_ok, forward, lambda _, stash, __: (idle_bTD, idle_figures, stash), x_bTD, stash, f)
    figures = jax.tree.map(jnp.add, figures, f_figures)
    # Micro-batch `done` leaves the last stage and is turned round at once (head, loss and its
    # gradient), the head shared by every stage: an all-to-all hands each 1/P of its tokens, and
    # their gradients come back to the last stage by the transposed all-to-all.
    done = t - (stages - 1)
    y_1tD = jax.lax.all_to_all(y_bTD.reshape(stages, 1, -1, y_bTD.shape[-1]), PIPELINE, 0, 0)[stages - 1]
    loss, shared_grads, d_y_1tD = jax.lax.cond(
        (done >= 0) & (done < micro), turn_round,
        lambda loss, grads, y, _: (loss, grads, _zeros(y)),
        loss, shared_grads, y_1tD, tuple(s_MPt[jnp.clip(done, 0, micro - 1), stage] for s_MPt in scored_MPt))
    d_y_bTD = jax.lax.all_to_all(jnp.broadcast_to(d_y_1tD, (stages, *d_y_1tD.shape)), PIPELINE, 0, 0)
    d_y_bTD = d_y_bTD.reshape(y_bTD.shape)
    # Backward slot: micro-batch b, from the residuals its forward slot stashed.
    block_grads, d_x_bTD = _slot(
        layout, b_ok, backward, lambda grads, _, __, d: (grads, _zeros(d)),
        block_grads, stash, b, jnp.where(last, d_y_bTD, cotangent_bTD))
    d_x_MbTD = jnp.where(b_ok & (stage == 0), d_x_MbTD.at[jnp.clip(b, 0, micro - 1)].set(d_x_bTD), d_x_MbTD)
    incoming_bTD = jax.lax.ppermute(y_bTD, PIPELINE, forward_pairs)
    cotangent_bTD = jax.lax.ppermute(d_x_bTD, PIPELINE, backward_pairs)
    return (incoming_bTD, cotangent_bTD, stash, loss, figures, shared_grads, block_grads, d_x_MbTD), None

  # Each stash slot as its residual varies: the router's statistics of the micro-batch's rows are the same
  # on every batch shard.
  stash = [_varying(jnp.zeros((slots, *r.shape), r.dtype), jax.typeof(r).mat.varying)
           for r, mine in zip(fixed, per_micro) if mine]
  start = (idle_bTD, idle_bTD, stash, _zeros(scale), idle_figures, _zeros(shared), _zeros(blocks),
           _zeros(x_MbTD))
  (_, _, _, loss, figures, shared_grads, block_grads, d_x_MbTD), _ = jax.lax.scan(tick, start, jnp.arange(ticks))
  # The input gradients are on the first stage (zeros elsewhere), which alone adds to the embedding's.
  (embed_grads,) = embed_vjp(d_x_MbTD)
  return loss, figures, {**jax.tree.map(jnp.add, shared_grads, embed_grads), STACKED: block_grads}
