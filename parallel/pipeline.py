"""Pipeline parallelism over `pipeline`: the stacked layers split into stages, micro-batches flow between them.

The model comes in three parts (embed, stacked blocks, head and loss); only
the blocks are pipelined. The whole step, gradients included, runs in one
`shard_map` manual over `pipeline` and the batch's axes (`expert`, `data`), so
each device keeps its own rows and every collective in it is one named here;
`tensor` stays under GSPMD, so Megatron's tensor parallelism composes inside
each stage. Each device differentiates its share of the loss with every weight
marked as differing between devices, so autodiff adds no collective of its
own; the gradients are summed once per step, after the schedule: the stage
weights' over the batch axes, the embedding's and head's over `pipeline` too,
and reduce-scattered over `data` where ZeRO-3 shards a weight (which enters the
map gathered, once per step).

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
  and its gradient), every stage running the head on 1/P of its tokens. The forward slot stashes the residuals of the stage's `jax.vjp`
  (what the remat policy keeps) and the backward slot applies them, so nothing
  is recomputed beyond the policy; a stage holds at most min(M, 2P - 1)
  micro-batches' residuals. Gradients accumulate inside the slots that make them.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.transformer import STACKED
from parallel import microbatch, schedules
from parallel.mesh import DATA, PIPELINE
from parallel.rules import BATCH_AXES, as_entry, entry_axes

MANUAL = (PIPELINE, *BATCH_AXES)


def loss_and_grads(layout, params, batch, scale=None):
  """(mean loss, gradients of `scale` x loss) under the layout's schedule, each gradient laid out as its weight."""
  grad_specs = jax.tree.map(_manual, layout.param_shardings)
  schedule = _one_f_one_b if layout.schedule == "1f1b" else _circular
  virtual = layout.virtual_stages if layout.schedule == "interleaved" else 1
  stages = layout.mesh.shape[PIPELINE]

  def body(params, inputs_BT, targets_BT, scale):
    loss, grads = schedule(layout, jax.tree.map(_varying, params), inputs_BT, targets_BT, scale)
    return jax.lax.psum(loss, MANUAL), jax.tree.map(_reduce, grads, grad_specs)

  # Stage weights whole over `data` (ZeRO-3 gathers them here, once per step), the rest whole everywhere.
  weight_specs = {k: jax.tree.map(lambda _: P(PIPELINE) if k == STACKED else P(), v) for k, v in params.items()}
  params = {**params, STACKED: _stage_major(params[STACKED], virtual, stages)}
  scale = jnp.ones((), jnp.float32) if scale is None else scale
  loss, grads = jax.shard_map(body, mesh=layout.mesh, in_specs=(weight_specs, P(BATCH_AXES), P(BATCH_AXES), P()),
                              out_specs=(P(), grad_specs), axis_names=set(MANUAL))(
                                  params, batch["inputs"], batch["targets"], scale)
  return loss, {**grads, STACKED: _stage_major(grads[STACKED], stages, virtual)}


def _manual(sharding):
  """The part of a weight's sharding over the map's manual axes: how its gradient leaves the map."""
  return P(*(as_entry(tuple(a for a in entry_axes(entry) if a in MANUAL)) for entry in sharding.spec))


def _varying(x):
  """`x` marked as differing between devices over every manual axis (its gradient then stays local)."""
  same = tuple(a for a in MANUAL if a not in jax.typeof(x).mat.varying)
  return jax.lax.pcast(x, same, to="varying") if same else x


def _reduce(grad, spec):
  """One device's gradient summed over the devices that share its weight: scattered over `data` where
  the weight is split over it (ZeRO-3), summed over every other manual axis it is not split over."""
  split = {a for entry in spec for a in entry_axes(entry)}
  if DATA in split:
    grad = jax.lax.psum_scatter(grad, DATA, scatter_dimension=tuple(spec).index(DATA), tiled=True)
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


def _run_stage(layout, params, blocks, x_bTD):
  return nnx.merge(layout.graphdef, {**params, STACKED: blocks}).run_blocks(x_bTD)[0]


def _shards(layout) -> int:
  return math.prod(layout.mesh.shape[a] for a in BATCH_AXES)


def _circular(layout, params, inputs_BT, targets_BT, scale):
  """This device's share of the loss and its gradients, the blocks run by the gpipe / interleaved schedule."""
  stages, virtual, micro = layout.mesh.shape[PIPELINE], layout.virtual_stages, layout.microbatches
  virtual = virtual if layout.schedule == "interleaved" else 1
  ticks = schedules.circular_ticks(stages=stages, virtual=virtual, micro=micro)
  out_ticks = jnp.array([schedules.circular_output_tick(m, stages=stages, virtual=virtual)
                         for m in range(micro)])
  ring = [(p, (p + 1) % stages) for p in range(stages)]
  stage = jax.lax.axis_index(PIPELINE)
  # Rows of this stage's share of the head: 1/P of every device's rows, the same on every stage.
  targets_PrT = microbatch.split(targets_BT, micro, layout.mesh).reshape(stages, -1, targets_BT.shape[1])

  def share(params):
    model = nnx.merge(layout.graphdef, params)
    x_MbTD = microbatch.split(model.embed_tokens(inputs_BT), micro, layout.mesh)
    chunk_layers = jax.tree.leaves(params[STACKED])[0].shape[0] // virtual

    def tick(incoming_bTD, t):
      m, s, valid = schedules.circular_slot(t, stage, stages=stages, virtual=virtual, micro=micro)
      x_bTD = jnp.where(s == 0, x_MbTD[jnp.clip(m, 0, micro - 1)], incoming_bTD)
      chunk = jax.tree.map(
          lambda w: jax.lax.dynamic_slice_in_dim(w, (s // stages) * chunk_layers, chunk_layers),
          params[STACKED])
      # A bubble tick does no work: the stage runs under lax.cond, and so does its backward pass.
      y_bTD = jax.lax.cond(valid, lambda x: _run_stage(layout, params, chunk, x), jnp.zeros_like, x_bTD)
      return jax.lax.ppermute(y_bTD, PIPELINE, ring), y_bTD

    _, y_tbTD = jax.lax.scan(tick, _varying(jnp.zeros_like(x_MbTD[0])), jnp.arange(ticks))
    # The last virtual stage lives on the last device: it sends each stage 1/P of its outputs' rows.
    y_PrTD = y_tbTD[out_ticks].reshape(stages, -1, *x_MbTD.shape[2:])
    y_rTD = jax.lax.all_to_all(y_PrTD, PIPELINE, 0, 0)[stages - 1]
    loss = model.head_loss(y_rTD, targets_PrT[stage]) / (stages * _shards(layout))
    return scale * loss, loss

  (_, loss), grads = jax.value_and_grad(share, has_aux=True)(params)
  return loss, grads


def _one_f_one_b(layout, params, inputs_BT, targets_BT, scale):
  """This device's share of the loss and its gradients by the 1F1B schedule, which runs the backward itself."""
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
  run_stage = functools.partial(_run_stage, layout, shared)

  def embed(shared):
    return split(nnx.merge(layout.graphdef, {**shared, STACKED: blocks}).embed_tokens(inputs_BT))

  def head_loss(shared, y_btD, targets_bt):
    loss = nnx.merge(layout.graphdef, {**shared, STACKED: blocks}).head_loss(y_btD, targets_bt)
    loss = loss / (micro * _shards(layout) * stages)
    return scale * loss, loss

  x_MbTD, embed_vjp = jax.vjp(embed, shared)
  # Every stage runs the head on 1/P of each micro-batch's tokens: this stage's share of the targets.
  targets_MPt = split(targets_BT).reshape(micro, stages, 1, -1)

  # The stage's vjp is a pytree of residual arrays. Those that carry the micro-batch's rows are stashed
  # from the forward slot for the backward slot; the rest (the weights, their casts to the compute
  # dtype, masks) depend on the weights alone, so they are made once here and shared by every slot.
  # A residual carries the rows exactly when its shape follows the micro-batch's: nothing in a
  # stage's forward pass reduces over the batch.
  residuals = lambda x_bTD: jax.tree.leaves(jax.vjp(run_stage, blocks, x_bTD)[1])
  per_rows = [one.shape != two.shape for one, two in zip(
      jax.eval_shape(residuals, x_MbTD[0]), jax.eval_shape(residuals, jnp.concatenate([x_MbTD[0]] * 2)))]
  _, weights_vjp = jax.vjp(run_stage, blocks, x_MbTD[0])
  fixed, treedef = jax.tree.flatten(weights_vjp)

  def forward(x_bTD, stash, f):
    y_bTD, stage_vjp = jax.vjp(run_stage, blocks, x_bTD)
    saved = [r for r, rows in zip(jax.tree.leaves(stage_vjp), per_rows) if rows]
    return y_bTD, [s.at[f % slots].set(r) for s, r in zip(stash, saved)]

  def backward(block_grads, stash, b, d_out_bTD):
    saved = iter([s[b % slots] for s in stash])
    stage_vjp = jax.tree.unflatten(treedef, [next(saved) if rows else r for r, rows in zip(fixed, per_rows)])
    d_blocks, d_x_bTD = stage_vjp(d_out_bTD)
    return jax.tree.map(jnp.add, block_grads, d_blocks), d_x_bTD

  def turn_round(loss, shared_grads, y_1tD, targets_1t):
    (_, f_loss), (head_grads, d_y_1tD) = jax.value_and_grad(head_loss, argnums=(0, 1), has_aux=True)(
        shared, y_1tD, targets_1t)
    return loss + f_loss, jax.tree.map(jnp.add, shared_grads, head_grads), d_y_1tD

  def tick(carry, t):
    incoming_bTD, cotangent_bTD, stash, loss, shared_grads, block_grads, d_x_MbTD = carry
    f, f_ok, b, b_ok = schedules.one_f_one_b_slots(t, stage, stages=stages, micro=micro)
    # Each slot runs under lax.cond, so a stage with nothing to do in it does no work, and each adds
    # what it makes to the carry in place. Forward slot: micro-batch f through this stage.
    x_bTD = jnp.where(stage == 0, x_MbTD[jnp.clip(f, 0, micro - 1)], incoming_bTD)
    y_bTD, stash = jax.lax.cond(
        f_ok, forward, lambda x, stash, _: (_varying(jnp.zeros_like(x)), stash), x_bTD, stash, f)
    # Micro-batch `done` leaves the last stage and is turned round at once (head, loss and its
    # gradient), the head shared by every stage: an all-to-all hands each 1/P of its tokens, and
    # their gradients come back to the last stage by the transposed all-to-all.
    done = t - (stages - 1)
    y_1tD = jax.lax.all_to_all(y_bTD.reshape(stages, 1, -1, y_bTD.shape[-1]), PIPELINE, 0, 0)[stages - 1]
    loss, shared_grads, d_y_1tD = jax.lax.cond(
        (done >= 0) & (done < micro), turn_round,
        lambda loss, grads, y, _: (loss, grads, _varying(jnp.zeros_like(y))),
        loss, shared_grads, y_1tD, targets_MPt[jnp.clip(done, 0, micro - 1), stage])
    d_y_bTD = jax.lax.all_to_all(jnp.broadcast_to(d_y_1tD, (stages, *d_y_1tD.shape)), PIPELINE, 0, 0)
    d_y_bTD = d_y_bTD.reshape(y_bTD.shape)
    # Backward slot: micro-batch b, from the residuals its forward slot stashed.
    block_grads, d_x_bTD = jax.lax.cond(
        b_ok, backward, lambda grads, _, __, d: (grads, _varying(jnp.zeros_like(d))),
        block_grads, stash, b, jnp.where(last, d_y_bTD, cotangent_bTD))
    d_x_MbTD = jnp.where(b_ok & (stage == 0), d_x_MbTD.at[jnp.clip(b, 0, micro - 1)].set(d_x_bTD), d_x_MbTD)
    incoming_bTD = jax.lax.ppermute(y_bTD, PIPELINE, forward_pairs)
    cotangent_bTD = jax.lax.ppermute(d_x_bTD, PIPELINE, backward_pairs)
    return (incoming_bTD, cotangent_bTD, stash, loss, shared_grads, block_grads, d_x_MbTD), None

  zeros = lambda tree: jax.tree.map(lambda x: _varying(jnp.zeros_like(x)), tree)
  stash = [jnp.zeros((slots, *r.shape), r.dtype) for r, rows in zip(fixed, per_rows) if rows]
  start = (zeros(x_MbTD[0]), zeros(x_MbTD[0]), zeros(stash), zeros(scale), zeros(shared), zeros(blocks),
           zeros(x_MbTD))
  (_, _, _, loss, shared_grads, block_grads, d_x_MbTD), _ = jax.lax.scan(tick, start, jnp.arange(ticks))
  # The input gradients are on the first stage (zeros elsewhere), which alone adds to the embedding's.
  (embed_grads,) = embed_vjp(d_x_MbTD)
  return loss, {**jax.tree.map(jnp.add, shared_grads, embed_grads), STACKED: block_grads}
