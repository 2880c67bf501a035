"""Pipeline parallelism over `pipeline`: the stacked layers split into stages, micro-batches flow between them.

The model comes in three parts (embed, stacked blocks, head and loss); only
the blocks are pipelined. Embedding and head run outside the stage loop,
sharded over the other axes and replicated over `pipeline` (as in MaxText), so
each stage computes them for its data shard.

- gpipe and interleaved run the circular schedule of parallel/schedules.py
  inside one `shard_map` over `pipeline` (the other axes stay under GSPMD, so
  tensor and data parallelism compose inside each stage); activations hop
  stage to stage with `ppermute`, and autodiff through it gives the gradients.
- 1f1b computes its own gradients: each tick every stage has one forward and
  one backward slot, run under `lax.cond` so idle slots cost nothing, the
  backward by `jax.vjp` of the stage on an input it stashed (recomputing the
  stage's forward), so at most 2P - 1 inputs are held.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.transformer import STACKED
from parallel import microbatch, schedules
from parallel.mesh import PIPELINE


def circular_loss(layout, params, batch):
  """Loss with the blocks run by the gpipe / interleaved schedule; differentiable."""
  model = nnx.merge(layout.graphdef, params)
  x_MbTD = microbatch.split(model.embed_tokens(batch["inputs"]), layout.microbatches, layout.mesh)
  y_MbTD = _circular_blocks(layout, params, x_MbTD)
  return model.head_loss(microbatch.merge(y_MbTD), batch["targets"])


def _stage_major(blocks, stages: int, virtual: int):
  """Reorder the layer axis so device p's contiguous shard holds chunks p, p + P, ..., p + (V-1)P."""
  def reorder(w_LX):
    w_VPlX = w_LX.reshape(virtual, stages, -1, *w_LX.shape[1:])
    return jnp.swapaxes(w_VPlX, 0, 1).reshape(w_LX.shape)
  return blocks if virtual == 1 else jax.tree.map(reorder, blocks)


def _run_stage(layout, params, blocks, x_bTD):
  return nnx.merge(layout.graphdef, {**params, STACKED: blocks}).run_blocks(x_bTD)[0]


def _specs(params):
  """Stacked blocks split over `pipeline` by their layer axis; everything else whole on each stage."""
  return {k: jax.tree.map(lambda _: P(PIPELINE) if k == STACKED else P(), v) for k, v in params.items()}


def _varying(x):
  """Mark a value that is the same on every stage as differing between them (a scan carry's start)."""
  return jax.lax.pcast(x, PIPELINE, to="varying")


def _from_stage(holds, x):
  """`x` as the stage where `holds` is true has it, on every stage: a psum over `pipeline` of it and zeros.

  The sum runs in float32, exact whatever the dtype since all but one term are zero: XLA's CPU compiler
  aborts on a bfloat16 psum here ("Invalid binary instruction opcode copy" in AllReducePromotion).
  """
  return jax.lax.psum(jnp.where(holds, x, 0).astype(jnp.float32), PIPELINE).astype(x.dtype)


def _circular_blocks(layout, params, x_MbTD):
  stages, virtual, micro = layout.mesh.shape[PIPELINE], layout.virtual_stages, layout.microbatches
  params = {**params, STACKED: _stage_major(params[STACKED], stages, virtual)}
  ticks = schedules.circular_ticks(stages=stages, virtual=virtual, micro=micro)
  out_ticks = jnp.array([schedules.circular_output_tick(m, stages=stages, virtual=virtual)
                         for m in range(micro)])
  ring = [(p, (p + 1) % stages) for p in range(stages)]

  def body(params, x_MbTD):
    stage = jax.lax.axis_index(PIPELINE)
    chunk_layers = jax.tree.leaves(params[STACKED])[0].shape[0] // virtual

    def tick(incoming_bTD, t):
      m, s, valid = schedules.circular_slot(t, stage, stages=stages, virtual=virtual, micro=micro)
      x_bTD = jnp.where(s == 0, x_MbTD[jnp.clip(m, 0, micro - 1)].astype(dtype), incoming_bTD)
      chunk = jax.tree.map(
          lambda w: jax.lax.dynamic_slice_in_dim(w, (s // stages) * chunk_layers, chunk_layers),
          params[STACKED])
      y_bTD = jnp.where(valid, _run_stage(layout, params, chunk, x_bTD), 0)
      return jax.lax.ppermute(y_bTD, PIPELINE, ring), y_bTD

    start = _varying(jnp.zeros_like(x_MbTD[0]))
    _, y_tbTD = jax.lax.scan(tick, start, jnp.arange(ticks))
    # The last virtual stage lives on the last device; share its outputs with every stage.
    return _from_stage(stage == stages - 1, y_tbTD[out_ticks])

  # The micro-batches enter in float32: autodiff sums their gradient over `pipeline` in every tick, a
  # psum that XLA's CPU compiler cannot take in bfloat16 (see _from_stage). Casting is exact both ways.
  dtype = x_MbTD.dtype
  return jax.shard_map(body, mesh=layout.mesh, in_specs=(_specs(params), P()), out_specs=P(),
                       axis_names={PIPELINE})(params, x_MbTD.astype(jnp.float32))


def one_f_one_b_loss_and_grads(layout, params, batch):
  """Loss and gradients by the 1F1B schedule, which runs the backward passes itself."""
  micro = layout.microbatches
  split = functools.partial(microbatch.split, count=micro, mesh=layout.mesh)

  def embed(params):
    return split(nnx.merge(layout.graphdef, params).embed_tokens(batch["inputs"]))

  x_MbTD, embed_vjp = jax.vjp(embed, params)
  loss, stage_grads, d_x_MbTD = _one_f_one_b(layout, params, x_MbTD, split(batch["targets"]))
  (embed_grads,) = embed_vjp(d_x_MbTD)
  return loss, jax.tree.map(jnp.add, embed_grads, stage_grads)


def _one_f_one_b(layout, params, x_MbTD, targets_MbT):
  stages, micro = layout.mesh.shape[PIPELINE], layout.microbatches
  ticks, slots = schedules.one_f_one_b_ticks(stages=stages, micro=micro), schedules.stash_slots(stages)
  forward_pairs = [(p, p + 1) for p in range(stages - 1)]
  backward_pairs = [(p + 1, p) for p in range(stages - 1)]

  def body(params, x_MbTD, targets_MbT):
    # Per-stage copies of the shared weights: differentiating the head through a
    # weight that is the same on every stage would sum its gradient over stages.
    params = {k: v if k == STACKED else jax.tree.map(_varying, v) for k, v in params.items()}
    stage = jax.lax.axis_index(PIPELINE)
    last = stage == stages - 1
    blocks = params[STACKED]

    def head_loss(params, y_bTD, targets_bT):
      return nnx.merge(layout.graphdef, params).head_loss(y_bTD, targets_bT) / micro

    def tick(carry, t):
      incoming_bTD, cotangent_bTD, stash_SbTD, loss, grads, d_x_MbTD = carry
      f, f_ok, b, b_ok = schedules.one_f_one_b_slots(t, stage, stages=stages, micro=micro)
      f_at, b_at = jnp.clip(f, 0, micro - 1), jnp.clip(b, 0, micro - 1)
      # Forward slot: micro-batch f through this stage, its input kept for the backward slot.
      # Each slot runs under lax.cond, so a stage with nothing to do in it does no work.
      x_bTD = jnp.where(stage == 0, x_MbTD[f_at], incoming_bTD)
      y_bTD = jax.lax.cond(f_ok, lambda x: _run_stage(layout, params, blocks, x), jnp.zeros_like, x_bTD)
      stash_SbTD = jnp.where(f_ok, stash_SbTD.at[f % slots].set(x_bTD), stash_SbTD)
      # The last stage turns micro-batch f round at once: head, loss and its gradient.
      head = jax.value_and_grad(head_loss, argnums=(0, 1))
      f_loss, (head_grads, d_y_bTD) = jax.lax.cond(
          last & f_ok, head, lambda p, y, _: (_varying(jnp.zeros((), jnp.float32)),
                                              (jax.tree.map(jnp.zeros_like, p), jnp.zeros_like(y))),
          params, y_bTD, targets_MbT[f_at])
      loss = loss + f_loss
      grads = jax.tree.map(jnp.add, grads, head_grads)

      # Backward slot: micro-batch b, recomputing the stage's forward from its stashed input.
      def backward(x_bTD, d_out_bTD):
        _, stage_vjp = jax.vjp(lambda w, x: _run_stage(layout, params, w, x), blocks, x_bTD)
        return stage_vjp(d_out_bTD)

      d_blocks, d_x_bTD = jax.lax.cond(
          b_ok, backward, lambda x, _: (jax.tree.map(jnp.zeros_like, blocks), jnp.zeros_like(x)),
          stash_SbTD[b % slots], jnp.where(last, d_y_bTD, cotangent_bTD))
      grads = {**grads, STACKED: jax.tree.map(jnp.add, grads[STACKED], d_blocks)}
      d_x_MbTD = jnp.where(b_ok & (stage == 0), d_x_MbTD.at[b_at].set(d_x_bTD), d_x_MbTD)
      incoming_bTD = jax.lax.ppermute(y_bTD, PIPELINE, forward_pairs)
      cotangent_bTD = jax.lax.ppermute(d_x_bTD, PIPELINE, backward_pairs)
      return (incoming_bTD, cotangent_bTD, stash_SbTD, loss, grads, d_x_MbTD), None

    zeros_bTD = _varying(jnp.zeros_like(x_MbTD[0]))
    start = (zeros_bTD, zeros_bTD, _varying(jnp.zeros((slots, *x_MbTD.shape[1:]), x_MbTD.dtype)),
             _varying(jnp.zeros((), jnp.float32)), jax.tree.map(jnp.zeros_like, params),
             _varying(jnp.zeros_like(x_MbTD)))
    (_, _, _, loss, grads, d_x_MbTD), _ = jax.lax.scan(tick, start, jnp.arange(ticks))
    # Head gradients live on the last stage and input gradients on the first: share them.
    shared = {k: jax.lax.psum(v, PIPELINE) for k, v in grads.items() if k != STACKED}
    return (jax.lax.psum(loss, PIPELINE), {**shared, STACKED: grads[STACKED]},
            _from_stage(stage == 0, d_x_MbTD))

  return jax.shard_map(body, mesh=layout.mesh, in_specs=(_specs(params), P(), P()),
                       out_specs=(P(), _specs(params), P()), axis_names={PIPELINE})(
                           params, x_MbTD, targets_MbT)
