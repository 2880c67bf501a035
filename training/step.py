"""The compiled train and eval steps: `(state, batch) -> (state, metrics)` under one jax.jit."""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from model import mtp
from model.moe import LOADS, ROUTER_BIAS
from model.placement import placed
from model.stack import STACKED
from parallel import context, microbatch, pipeline, placement
from parallel.mesh import SEQUENCE
from training import grpo, lora, loss_scale, preference, schedule_free
from training.optimizer import learning_rate
from training.state import Layout, abstract_inputs

# Optimizers whose update runs nonlinear iterations (Newton-Schulz) or averages iterates, where finite
# inputs are not shown to give a finite state: their guard reads the whole new state.
WHOLE_STATE_OPTIMIZERS = ("muon", "schedule_free_adamw")


def normalized_weights(batch):
  """`batch` with its per-token loss weights (where it has them) scaled to average 1 over the whole batch.

  Fine-tuning on completions weights the answer's tokens 1 and the rest 0 (input_pipeline/data.py). Scaled
  here, before any split into micro-batches or pipeline slots, the mean of weight x loss that each part
  takes (chunked_cross_entropy) averages to the mean over the batch's weighted tokens on any layout. A
  batch without a weighted token keeps its zeros: its loss is 0.
  """
  if "weights" not in batch:
    return batch
  weights_BT = batch["weights"]
  return {**batch, "weights": weights_BT * (weights_BT.size / jnp.maximum(weights_BT.sum(), 1.0))}


def objective(layout: Layout, params, batch):
  """(what training differentiates, statistics with the cross-entropy (the preference loss under
  objective=dpo, the policy loss under objective=grpo) and any router figures)."""
  if layout.preference is not None:
    return preference.objective(layout, params, batch)
  if layout.grpo is not None:
    return grpo.objective(layout, params, batch)
  model = nnx.merge(layout.graphdef, params)
  order_T = context.token_order(layout.context, batch["inputs"].shape[1], layout.mesh.shape[SEQUENCE])
  if order_T is None:
    return model.objective(batch["inputs"], batch["targets"], weights_BT=batch.get("weights"))
  # Ring attention balances causal work over a zig-zag token order; the model
  # follows token positions, and the mean loss does not care about order.
  ordered = {name: batch_BT[:, order_T] for name, batch_BT in batch.items()}
  return model.objective(ordered["inputs"], ordered["targets"], jnp.asarray(order_T), ordered.get("weights"))


def reported_loss(stats: dict, objective_value):
  """The loss a step reports (and pops from `stats`): the cross-entropy, or the preference or policy loss, without
  router losses, so that dense and MoE runs compare."""
  return next((stats.pop(key) for key in ("cross_entropy", preference.LOSS, grpo.LOSS) if key in stats),
              objective_value)


def loss_fn(layout: Layout, params, batch) -> jax.Array:
  """The next-token cross-entropy (over the weighted tokens, where the batch weights them), or the preference
  loss under objective=dpo."""
  value, stats = objective(layout, params, normalized_weights(batch))
  return reported_loss(stats, value)


def schedule_grad_fn(layout: Layout, scale=None, weights=None):
  """(trained, batch) -> ((loss, stats), grads) for the layout: gradients belong to the pipeline schedule.

  With a loss `scale` the gradients are of scale x loss (float16 loss scaling); the loss returned
  is unscaled. A pipeline's loss and statistics are the means over its micro-batches, as
  grad_accum's are over its own (parallel/pipeline.py). `weights` makes the model's parameters of what trains
  (LoRA's adapters merged into the frozen weights); without, what trains is the parameters.
  """
  if layout.schedule != "none":  # parallel/checks.py keeps LoRA off pipelines
    return lambda p, b: pipeline.loss_and_grads(layout, p, b, scale)
  loss_of = lambda p, b: objective(layout, p if weights is None else weights(p), b)
  if scale is None:
    return jax.value_and_grad(loss_of, has_aux=True)

  def scaled(p, b):
    loss, stats = loss_of(p, b)
    return loss * scale, (loss, stats)

  def grad_fn(p, b):
    (_, loss_stats), grads = jax.value_and_grad(scaled, has_aux=True)(p, b)
    return loss_stats, grads

  return grad_fn


def loss_and_grads(layout: Layout, params, batch, grad_accum: int, scale=None, weights=None):
  """((objective, stats), gradients), each the mean over `grad_accum` micro-batches of the batch.

  Under a loss `scale` the gradients stay scaled: the caller checks them for overflow, then unscales. `params` is
  what trains (schedule_grad_fn's `weights`).
  """
  grad_fn = schedule_grad_fn(layout, scale, weights)
  batch = normalized_weights(batch)
  if grad_accum == 1:
    return grad_fn(params, batch)

  def accumulate(carry, micro_batch):
    (loss, stats), grads = grad_fn(params, micro_batch)
    grads = jax.tree.map(jnp.add, carry[1], grads)
    return (jax.tree.map(jnp.add, carry[0], (loss, stats)),
            jax.lax.with_sharding_constraint(grads, layout.trained_shardings)), None

  micro_batches = jax.tree.map(lambda x: microbatch.split(x, grad_accum, layout.mesh), batch)
  first = jax.tree.map(lambda x: x[0], micro_batches)
  zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, first))
  (loss_stats, grad_sum), _ = jax.lax.scan(accumulate, zeros, micro_batches)
  return jax.tree.map(lambda x: x / grad_accum, (loss_stats, grad_sum))


def all_finite(tree) -> jax.Array:
  """Whether every floating-point leaf of `tree` is finite everywhere (a scalar bool)."""
  checks = [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)]
  return jnp.logical_and.reduce(jnp.stack(checks)) if checks else jnp.bool_(True)


def kept(finite, new, old):
  """`new` where the scalar `finite` holds, else `old`, leaf by leaf.

  A bfloat16 leaf (a moment stored narrow) is selected in float32, so that the select fuses into its update
  as into a float32 one and the CPU compiles both alike: a bfloat16 select made it contract v's update into
  a fused multiply-add, and bfloat16 moments were no longer float32's rounded.
  """
  wide = lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
  return jax.tree.map(lambda n, o: jnp.where(finite, wide(n), wide(o)).astype(n.dtype), new, old)


def balancing_bias_updates(updates, loads: dict, rate: float):
  """`updates` with each MoE layer's router bias moved by `rate` against its experts' load error (DeepSeek-V3's
  auxiliary-loss-free balancing): up where an expert took less than the layer's mean load, down where more.

  The bias changes the choice of experts only, so its gradient is zero and the optimizer's update of it is
  replaced, not added to (weight decay would shrink it otherwise). `loads` holds, under the key of each stack
  with routed layers (the scanned blocks, the multi-token prediction modules), each of its MoE layers' share of
  the choices per expert, [MoE layers, experts], stacked as its biases are."""
  def update(path, u):
    if jax.tree_util.keystr(path[-1:]) != f"['{ROUTER_BIAS}']":
      return u
    loads_LE = loads[path[0].key]
    return (rate * jnp.sign(loads_LE.mean(-1, keepdims=True) - loads_LE)).astype(u.dtype)
  return jax.tree_util.tree_map_with_path(update, updates)


def make_train_step(layout: Layout, config, donate: bool = True):
  """The jitted step with explicit shardings for every leaf; the incoming state is donated unless a
  failed step must be redone from it (fault_tolerance=survive)."""
  schedule = learning_rate(config)
  grad_accum, growth_interval = config.grad_accum, config.precision.loss_scale_growth
  whole_state = config.nonfinite_check == "full" or config.optimizer.name in WHOLE_STATE_OPTIMIZERS

  def train_step(state, batch):
    scale = state["loss_scale"]["scale"] if "loss_scale" in state else None
    trained = lora.ADAPTERS if layout.lora else "params"
    weights = functools.partial(lora.merged, layout.lora, state["params"]) if layout.lora else None
    with placed(placement.for_layout(layout)):
      # Schedule-free takes its gradient between the averaged weights the state holds and its base sequence,
      # laid out as the parameters: under ZeRO-1 the base sequence is gathered once, not in each layer loop.
      at = jax.lax.with_sharding_constraint(schedule_free.gradient_point(state["opt_state"], state[trained]),
                                            layout.trained_shardings)
      if layout.preference is not None:  # under LoRA the frozen parameters are the reference
        batch = preference.with_reference(layout, state.get("reference", state["params"]), batch)
      if layout.grpo is not None:
        batch = grpo.with_reference(layout, state.get("reference", state["params"]), batch)
      (loss, stats), grads = loss_and_grads(layout, at, batch, grad_accum, scale, weights)
    if scale is not None:
      grads = jax.tree.map(lambda g: g / scale, grads)
    grad_norm = optax.tree.norm(grads)
    lr = schedule(state["step"])
    loss_finite, grads_finite = jnp.isfinite(loss), jnp.isfinite(grad_norm)
    updates, opt_state = layout.tx.update(grads, state["opt_state"], state[trained])
    loads = {stack: stats.pop(key) for stack, key in ((STACKED, LOADS), (mtp.MTP, mtp.LOADS)) if key in stats}
    if loads and not layout.lora:  # LoRA's router biases are frozen with the rest (training/validate.py)
      updates = balancing_bias_updates(updates, loads, layout.model.moe_bias_rate)
    params = optax.apply_updates(state[trained], updates)
    # Nothing non-finite reaches the state: a step that would put one there is dropped and counted, and
    # the loop applies config.nonfinite to the count. Under float16 this is also the loss scaler's
    # overflow skip. Adam(W) and SGD (with momentum) are judged by scalars already at hand, so the select
    # fuses into the update and no pass reads the new state again: from a finite state, a finite gradient
    # norm bounds every g and g^2 (clipped or not, accumulated or not) and so the moments, and a finite
    # learning rate keeps the step finite unless it leaves float32's range (lr near 3.4e38, or weights
    # past 1e19 under adam_l2's decay). Muon's iterations and schedule-free's averages have no such
    # bound: they check the whole new state, as nonfinite_check=full does for any optimizer.
    if whole_state:
      finite = loss_finite & grads_finite & all_finite((params, opt_state))  # what trains, and its moments
    else:
      finite = loss_finite & grads_finite & jnp.isfinite(lr)
    # Under loss scaling, a gradient that overflows while the loss is finite is the scaler's
    # routine (it halves the scale), not a fault: `skipped`, which nonfinite= acts on, leaves it out.
    overflow = (scale is not None) & loss_finite & ~grads_finite
    # The weights are kept or dropped first: their update reads the old moments, which the moments' own
    # update overwrites in place, so with the order left open XLA would copy every moment beforehand.
    params, finite = jax.lax.optimization_barrier((kept(finite, params, state[trained]), finite))
    # What does not train (a preference objective's reference, LoRA's frozen parameters) passes through.
    new_state = {**state, "step": state["step"] + 1, trained: params,
                 "opt_state": kept(finite, opt_state, state["opt_state"]),
                 "skipped": state["skipped"] + (~finite & ~overflow).astype(jnp.int32)}
    # `loss` is the cross-entropy (or preference loss), comparable across dense and MoE runs; router figures
    # ride along.
    metrics = {**stats, "loss": reported_loss(stats, loss), "grad_norm": grad_norm, "lr": lr,
               "skipped": new_state["skipped"]}
    if scale is not None:
      new_state["loss_scale"] = loss_scale.update(state["loss_scale"], finite, growth_interval)
      metrics["loss_scale"] = scale
    return new_state, metrics

  # One sharding for every entry of the batch: inputs, targets and, fine-tuning on completions, weights.
  return jax.jit(train_step, in_shardings=(layout.state_shardings, layout.batch_sharding),
                 out_shardings=(layout.state_shardings, layout.replicated()), donate_argnums=0 if donate else ())


def model_entries(state: dict) -> dict:
  """The entries of a train state (or its abstract state) the model's weights are made of: the parameters, and
  LoRA's adapters (`model_weights` merges them)."""
  return {key: state[key] for key in ("params", lora.ADAPTERS) if key in state}


def evaluated(state: dict) -> dict:
  """What the eval step reads of a train state: model_entries, and the reference a preference loss compares
  them with."""
  return {**model_entries(state), **({"reference": state["reference"]} if "reference" in state else {})}


def model_weights(layout: Layout, state: dict) -> dict:
  """The weights the model computes with: the parameters, LoRA's adapters merged in."""
  return lora.merged(layout.lora, state["params"], state[lora.ADAPTERS]) if layout.lora else state["params"]


def make_eval_step(layout: Layout):
  """Held-out loss for one batch, on the same mesh and shardings as training: (evaluated(state), batch) -> loss."""

  def eval_step(weights, batch):
    with placed(placement.for_layout(layout)):
      if layout.preference is not None:
        batch = preference.with_reference(layout, weights.get("reference", weights["params"]), batch)
      return loss_fn(layout, model_weights(layout, weights), batch)

  return jax.jit(eval_step, in_shardings=(evaluated(layout.state_shardings), layout.batch_sharding),
                 out_shardings=layout.replicated())


def compile_train_step(layout: Layout, config, weighted: bool = False):
  """The train step compiled ahead for `layout`, from abstract inputs (batches with loss weights where
  `weighted`): nothing is allocated."""
  return make_train_step(layout, config).lower(*abstract_inputs(layout, config, weighted)).compile()
