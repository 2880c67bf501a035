"""Optimizers and learning-rate schedules from `config.optimizer` and `config.schedule` (optax).

OPTIMIZERS holds each optimizer's update rule beside what it costs beyond the
gradients' reduction (parallel/costs.py's terms), which measure/ composes; the
size of its state is read off the rule itself (`state_bytes`).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from model import mup
from model.value_embeds import VALUE_EMBEDS
from parallel.costs import Weight
from training import muon, schedule_free


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An update rule and its costs beside the gradients' reduction."""
  # (config.optimizer, learning rate, decays: params -> where weight decay applies, params, logical, mesh,
  # moment_rules) -> its optax transformation
  rule: Callable[..., optax.GradientTransformation]
  # (config.optimizer, the moments' rules table, mesh sizes, weights): {(kind, axes): bytes one device
  # sends per step for the update itself}
  sent: Callable[..., dict[tuple[str, str], int]]
  flops: Callable[..., int]  # the same arguments: the update's matmul FLOPs per device per step
  gathered: int = 1  # copies ZeRO-1 all-gathers after the update: the weights, and any it keeps beside them
  check: Callable[..., None] = lambda config: None  # refuses the config's other settings it cannot run with


def _nothing_sent(opt, moments, mesh: dict, weights: list[Weight]) -> dict:
  return {}


def _no_flops(opt, moments, mesh: dict, weights: list[Weight]) -> int:
  return 0


def _muon(opt, lr, decays, params, logical, mesh, moment_rules):
  return muon.muon(opt, lr, decays, muon.matrices(params, logical, mesh, moment_rules, opt.muon_iteration))


def _check_schedule_free(config):
  if config.schedule.decay != "constant":
    raise ValueError(f"optimizer.name='schedule_free_adamw' averages its iterates in place of a decay; set "
                     f"schedule.decay=constant (warmup, then the peak rate), not {config.schedule.decay!r}.")
  if config.precision.moments != "float32":
    raise ValueError(f"precision.moments={config.precision.moments!r}: schedule-free's state holds z, a copy of "
                     "the weights, which would be rounded; keep precision.moments=float32.")


def _schedule_free_adamw(opt, lr, decays, params, *_):
  return schedule_free.schedule_free_adamw(lr, opt.b1, opt.b2, opt.eps, opt.weight_decay, decays(params))


def _adamw(opt, lr, decays, params, *_):
  # Decoupled decay (Loshchilov & Hutter): shrink the weights apart from the adaptive step.
  return optax.adamw(lr, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay, mask=decays(params))


def _adam_l2(opt, lr, decays, params, *_):
  # L2 in the loss: the decay term is added to the gradient before Adam rescales it.
  return optax.chain(optax.add_decayed_weights(opt.weight_decay, decays(params)),
                     optax.adam(lr, opt.b1, opt.b2, opt.eps))


OPTIMIZERS = {
    "adamw": Optimizer(_adamw, _nothing_sent, _no_flops),
    "adam": Optimizer(lambda opt, lr, *_: optax.adam(lr, opt.b1, opt.b2, opt.eps), _nothing_sent, _no_flops),
    "adam_l2": Optimizer(_adam_l2, _nothing_sent, _no_flops),
    "sgd": Optimizer(lambda opt, lr, *_: optax.sgd(lr), _nothing_sent, _no_flops),
    "momentum": Optimizer(lambda opt, lr, *_: optax.sgd(lr, momentum=opt.momentum), _nothing_sent, _no_flops),
    "muon": Optimizer(_muon, muon.sent, muon.newton_schulz_flops),
    # Schedule-free's gradient point y = b1 x + (1 - b1) z needs its base sequence z, kept on the moments'
    # shards, gathered beside the weights (training/step.py).
    "schedule_free_adamw": Optimizer(_schedule_free_adamw, _nothing_sent, _no_flops, gathered=2,
                                     check=_check_schedule_free),
}


def registered(name: str) -> Optimizer:
  """OPTIMIZERS' entry for optimizer.name `name`, refused in one line where there is none."""
  if name not in OPTIMIZERS:
    raise ValueError(f"optimizer.name={name!r} is unknown; use one of {', '.join(OPTIMIZERS)}.")
  return OPTIMIZERS[name]


MUP_OPTIMIZERS = ("adamw", "adam", "adam_l2")  # muP's learning-rate scaling (model/mup.py) is Adam's


def learning_rate(config) -> optax.Schedule:
  """Linear warmup from 0, then cosine decay to final_lr_ratio * lr, a constant, or WSD's stable rate and
  linear decay over the last schedule.decay_steps."""
  opt, sched = config.optimizer, config.schedule
  if sched.decay == "constant":
    after_warmup = optax.constant_schedule(opt.lr)
  elif sched.decay == "cosine":
    decay_steps = max(config.steps - sched.warmup_steps, 1)
    after_warmup = optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=sched.final_lr_ratio)
  elif sched.decay == "wsd":
    # Warmup-stable-decay (Hu et al. 2024, MiniCPM): the decay depends on the budget only through where it
    # starts, so every step before it is the same whatever `steps` is, and a stable run's checkpoint there
    # decays into that budget (config.branch_from).
    stable = config.steps - sched.warmup_steps - sched.decay_steps
    if sched.decay_steps < 1 or stable < 0:
      raise ValueError(f"schedule.decay_steps={sched.decay_steps} must be at least 1 and at most steps - "
                       f"warmup_steps = {config.steps - sched.warmup_steps} under schedule.decay='wsd'; about a "
                       "fifth of the steps is usual.")
    after_warmup = optax.join_schedules(
        [optax.constant_schedule(opt.lr),
         optax.linear_schedule(opt.lr, opt.lr * sched.final_lr_ratio, sched.decay_steps)], [stable])
  else:
    raise ValueError(f"schedule.decay={sched.decay!r} is unknown; use cosine, constant or wsd.")
  if sched.warmup_steps <= 0:
    return after_warmup
  warmup = optax.linear_schedule(0.0, opt.lr, sched.warmup_steps)
  return optax.join_schedules([warmup, after_warmup], [sched.warmup_steps])


# What a parameter is, from its name: decay is decided by kind, never by rank, because a
# bias may be stored with several axes (GPT-2's QKV bias is (3, heads, head_dim), a MoE
# expert's bias (experts, mlp)) and an embedding table is a matrix.
EMBEDDING_NAMES = ("embed", VALUE_EMBEDS)  # the token tables: model.value_embeds' beside the input embedding
MATRIX_NAMES = ("router", "head")  # besides every `*kernel`: the MoE router, Llama's untied LM head
VECTOR_NAMES = ("scale",)  # besides every `*bias`: norm gains


def parameter_kind(path) -> str:
  """'embedding', 'matrix' or 'vector' for the parameter at tree path `path`; refuses an unknown name."""
  keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  if keys[0] in EMBEDDING_NAMES:
    return "embedding"
  if keys[-1].endswith("kernel") or keys[-1] in MATRIX_NAMES:
    return "matrix"
  if keys[-1].endswith("bias") or keys[-1] in VECTOR_NAMES:
    return "vector"
  raise ValueError(f"Parameter {jax.tree_util.keystr(path)} has no weight-decay kind; name it "
                   f"*kernel, *bias or one of {MATRIX_NAMES + VECTOR_NAMES}, or extend "
                   "training/optimizer.py's names.")


def decay_mask(params, config):
  """True where weight decay applies: matrices always, embeddings and vectors (biases, gains) if asked."""
  return _decay_mask(params, config.optimizer)


def _decay_mask(params, opt):
  decays = {"matrix": True, "embedding": opt.decay_embeddings, "vector": opt.decay_1d}
  return jax.tree_util.tree_map_with_path(lambda path, _: decays[parameter_kind(path)], params)


def make_optimizer(config, params, logical=None, mesh=None, moment_rules=None) -> optax.GradientTransformation:
  """Global-norm clipping followed by the configured update rule, driven by the schedule.

  Muon reads which parameters are matrices off their logical axes (`logical`, the parameters' tree of
  PartitionSpecs of logical names); on a `mesh` it gathers each matrix's momentum from where the moments lie
  (`moment_rules`) as optimizer.muon_iteration says (training/muon.py).
  """
  opt = config.optimizer
  lr = learning_rate(config)
  if config.mup.base_width and opt.name not in MUP_OPTIMIZERS:
    raise ValueError(f"mup.base_width={config.mup.base_width} scales Adam's learning rates; optimizer.name="
                     f"{opt.name!r} would need its own (muP's SGD and Muon scalings are not built): use one of "
                     f"{', '.join(MUP_OPTIMIZERS)}, or leave mup.base_width at 0.")
  entry = registered(opt.name)
  entry.check(config)
  rule = entry.rule(opt, lr, lambda p: _decay_mask(p, opt), params, logical, mesh, moment_rules)
  if config.mup.base_width:
    rule = optax.chain(rule, _scaled_by(mup.learning_rate_factors(
        params, logical, config.model.embed_dim / config.mup.base_width)))
  if config.precision.moments not in ("float32", "bfloat16"):
    raise ValueError(f"precision.moments={config.precision.moments!r} is unknown; use float32 or bfloat16.")
  if config.precision.moments == "bfloat16":
    rule = stored_as(jnp.bfloat16, rule)
  # Clipping is always in the chain (at an infinite norm when off), so a checkpoint's
  # optimizer state has the same structure whatever the clipping setting.
  return optax.chain(optax.clip_by_global_norm(opt.clip_norm if opt.clip_norm > 0 else float("inf")), rule)


def _scaled_by(factors) -> optax.GradientTransformation:
  """Each parameter's update times its factor: per-parameter learning rates (muP's)."""
  return optax.stateless(lambda updates, params=None: jax.tree.map(lambda u, f: u * f, updates, factors))


def stored_as(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` with its floating-point state (Adam's m and v) kept in `dtype` between steps.

  The update itself runs in float32 on the widened state, so only storage is
  rounded: half the optimizer memory, at the cost of bfloat16's 8-bit mantissa in m and v.
  """
  def narrow(state):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

  def widen(state):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == dtype else x, state)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, widen(state), params)
    return updates, narrow(state)

  return optax.GradientTransformation(lambda params: narrow(inner.init(params)), update)


def state_bytes(opt, moments: str, weights: list[Weight]) -> list[int]:
  """Bytes of state optimizer `opt` (config.optimizer), its moments stored in `moments`, keeps per element of
  each weight (Adam's m and v, Muon's momentum, schedule-free's z...), read off the abstract state of its
  rule (jax.eval_shape of its init: nothing allocated; clipping and muP's scaling keep none). A state leaf
  is the weight's whose tree path its own ends in, with the weight's shape, as training/state.py lays the
  moments out."""
  params, logical = {}, {}
  for w in weights:
    *parents, last = w.path
    params_node, logical_node = params, logical
    for key in parents:
      params_node, logical_node = params_node.setdefault(key, {}), logical_node.setdefault(key, {})
    params_node[last], logical_node[last] = jax.ShapeDtypeStruct(w.shape, jnp.float32), PartitionSpec(*w.axes)
  rule = registered(opt.name).rule(opt, 0.0, lambda p: _decay_mask(p, opt), params, logical, None, None)
  state = jax.eval_shape((stored_as(jnp.bfloat16, rule) if moments == "bfloat16" else rule).init, params)
  owner_of = {w.path: i for i, w in enumerate(weights)}
  per_element = [0] * len(weights)
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    owner = next((owner_of[keys[i:]] for i in range(len(keys)) if keys[i:] in owner_of), None)
    if owner is not None and leaf.shape == weights[owner].shape:
      per_element[owner] += leaf.dtype.itemsize
  return per_element
