"""The train state (step, params, optimizer state, skipped-update count) as plain pytrees, and where each leaf lives.

Params are a pure dict of arrays (`nnx.to_pure_dict`): optax, orbax and the
jitted step see ordinary pytrees, and `nnx.merge(graphdef, params)` rebuilds
the module inside the trace.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model import mup
from model.config import ModelConfig
from model.families import FAMILIES
from model.transformer import STACKED, chunk_positions
from parallel import rules, schedules, stages
from parallel.checks import attention_kernel, check_backend, check_divides
from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE, make_mesh
from training import grpo, lora, loss_scale, preference
from training.optimizer import make_optimizer
from training.lora import Lora
from training.grpo import Grpo
from training.preference import Preference


def model_config(config) -> ModelConfig:
  """The frozen model description the model sees: every field of `config.model`, the compute dtype, the
  experts' and latent attention's settings (tests/test_model_init.py holds config.model's fields to ModelConfig's)."""
  model, moe = config.model, config.moe
  fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig) if hasattr(model, f.name)}
  return ModelConfig(**fields, compute_dtype=config.precision.compute, num_experts=moe.experts,
                     moe_every=moe.every, moe_first_dense=moe.first_dense, moe_dense_width=moe.dense_width,
                     moe_top_k=moe.top_k, moe_capacity_factor=moe.capacity_factor,
                     moe_dropless=moe.dropless, moe_renormalize=moe.renormalize, moe_shared_width=moe.shared_width,
                     moe_balance_weight=moe.balance_weight, moe_z_weight=moe.z_weight, moe_score=moe.score,
                     moe_groups=moe.groups, moe_group_top_k=moe.group_top_k, moe_scale=moe.scale,
                     moe_shared_gate=moe.shared_gate, moe_router_bias=moe.router_bias, moe_bias_rate=moe.bias_rate,
                     mup_base_width=config.mup.base_width, mla_kv_rank=config.mla.kv_rank,
                     mla_q_rank=config.mla.q_rank, mla_rope_dim=config.mla.rope_dim, mla_v_dim=config.mla.v_dim,
                     mla_score_scale=config.mla.score_scale)


def build_model(cfg: ModelConfig, seed: int) -> nnx.Module:
  return mup.scale_initialization(FAMILIES[cfg.family].build(cfg, nnx.Rngs(params=seed)))


@dataclasses.dataclass(frozen=True)
class Layout:
  """Everything about a run that is fixed before the first step: mesh, model, optimizer, shardings."""
  mesh: Mesh
  model: ModelConfig
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  state_shardings: dict
  used_shardings: dict  # each weight as the step uses it: the parameters' layout without ZeRO's split
  moment_shardings: dict  # each weight's optimizer moments (ZeRO-1 and 3 split them over data, and so the gradient)
  batch_sharding: NamedSharding
  abstract_state: dict
  schedule: str  # the pipeline schedule; "none" on a mesh without pipeline stages
  microbatches: int
  virtual_stages: int
  stage_units: tuple[int, ...] | None  # units in each chunk (virtual stage) when unequal; None: equal chunks
  context: str  # the attention strategy over `sequence`; "none" on a mesh without sequence shards
  initial_loss_scale: float | None  # float16's starting loss scale; None without loss scaling
  preference: Preference | None = None  # objective=dpo's settings; None for a language model
  lora: Lora | None = None  # LoRA's settings: the state's "adapters" train, its "params" stay frozen
  grpo: Grpo | None = None  # objective=grpo's settings
  logical: dict | None = None  # the parameters' logical PartitionSpecs

  @property
  def trained_shardings(self):
    """Where what the optimizer updates lies: the adapters under LoRA, else the parameters."""
    return self.state_shardings[lora.ADAPTERS if self.lora else "params"]

  @property
  def param_shardings(self):
    return self.state_shardings["params"]

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())


def plan(config, devices=None) -> Layout:
  """Check the config against the mesh and derive every sharding, without allocating arrays."""
  mesh = make_mesh(config.mesh, devices, config.sharding.fsdp_group)
  cfg = model_config(config)
  check_divides(cfg, dict(mesh.shape), batch_size=config.batch_size, grad_accum=config.grad_accum,
                zero=config.sharding.zero, pipeline=config.pipeline, context=config.attention.context,
                fsdp_group=config.sharding.fsdp_group)
  check_backend(cfg, mesh.devices.flat[0])
  cfg = dataclasses.replace(cfg, attention=attention_kernel(cfg, dict(mesh.shape), mesh.devices.flat[0].platform))
  micro = schedules.micro_batches(config, mesh.shape[PIPELINE])
  sequences = config.batch_size * (1 if preference.settings(config) is None else 2)  # a pair is two
  rows = sequences // micro // (mesh.shape[DATA] * mesh.shape[EXPERT])
  to_positions = lambda tokens: chunk_positions(tokens, rows, mesh.shape[SEQUENCE]) if tokens else 0
  cfg = dataclasses.replace(cfg, loss_chunk=to_positions(cfg.loss_chunk), mlp_chunk=to_positions(cfg.mlp_chunk),
                            gathered_lookup=bool(config.sharding.fsdp_group))
  # The model stays mesh-agnostic: parameters are created unplaced, and the
  # shardings below come from their logical names through parallel/rules.py.
  with nnx.use_eager_sharding(False):
    abstract_model = nnx.eval_shape(lambda: build_model(cfg, config.seed))
  graphdef, abstract_params = nnx.split(abstract_model)
  logical = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
  params_abstract = nnx.to_pure_dict(abstract_params)
  zero, axis = config.sharding.zero, rules.fsdp_axis(config.sharding)
  stage_units = stages.stage_units(cfg, config.pipeline, mesh.shape[PIPELINE])
  # A stack of unequal stages lies split over `pipeline` by `embed` (parallel/stages.py).
  stack_rules = (lambda rule_set: rule_set) if stage_units is None else rules.split_by_embed

  def placed(rule_set):
    """Shardings by `rule_set`, the stack's by stack_rules(rule_set)."""
    return {**rules.shardings(logical, mesh, rule_set),
            STACKED: rules.shardings(logical[STACKED], mesh, stack_rules(rule_set))}

  param_shardings = placed(rules.weight_rules(zero, axis))
  moment_shardings = placed(rules.optimizer_rules(zero, axis))
  # What the optimizer updates: the parameters, or under LoRA the adapters, laid out by the same rules.
  adapters = lora.settings(config)
  trained, trained_logical = params_abstract, logical
  trained_moments = moment_shardings
  if adapters:
    trained, trained_logical = lora.abstract_adapters(adapters, params_abstract, logical)
    trained_moments = rules.shardings(trained_logical, mesh, rules.optimizer_rules(zero, axis))
  # The optimizer lays out what it gathers (Muon's hidden matrices, all in the stack) as the stack's moments lie.
  tx = make_optimizer(config, trained, trained_logical, mesh, stack_rules(rules.optimizer_rules(zero, axis)))
  opt_abstract = jax.eval_shape(tx.init, trained)
  replicated = NamedSharding(mesh, P())
  opt_shardings = _moment_leaves(opt_abstract, trained, trained_moments, replicated)
  state_shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings,
                     "skipped": replicated}
  counter = jax.ShapeDtypeStruct((), jnp.int32)
  abstract_state = {"step": counter, "params": params_abstract, "opt_state": opt_abstract,
                    "skipped": counter}
  if adapters:
    abstract_state["params"] = lora.frozen(adapters, params_abstract)
    abstract_state[lora.ADAPTERS] = trained
    state_shardings[lora.ADAPTERS] = rules.shardings(trained_logical, mesh, rules.weight_rules(zero, axis))
  if preference.keeps_reference(config) and not adapters:  # the frozen weights the policy is compared with
    # (under LoRA the frozen parameters are that reference already), laid out as its own
    abstract_state["reference"], state_shardings["reference"] = params_abstract, param_shardings
  if loss_scale.uses_loss_scaling(config):
    abstract_state["loss_scale"] = jax.eval_shape(loss_scale.initial, float(config.precision.loss_scale))
    state_shardings["loss_scale"] = {"scale": replicated, "good_steps": replicated}
  return Layout(mesh=mesh, model=cfg, graphdef=graphdef, tx=tx, state_shardings=state_shardings,
                used_shardings=placed(rules.weight_rules(0)), moment_shardings=moment_shardings,
                batch_sharding=rules.named(mesh, "batch", "length"), abstract_state=abstract_state,
                schedule=config.pipeline.schedule if mesh.shape[PIPELINE] > 1 else "none",
                microbatches=config.pipeline.microbatches,
                virtual_stages=schedules.virtual_stages(config.pipeline), stage_units=stage_units,
                context=config.attention.context if mesh.shape[SEQUENCE] > 1 else "none",
                initial_loss_scale=float(config.precision.loss_scale) if loss_scale.uses_loss_scaling(config) else None,
                preference=preference.settings(config), lora=adapters, grpo=grpo.settings(config),
                logical=logical)


def _moment_leaves(opt_state, params, moment_shardings, other):
  """Each optimizer-state leaf's sharding: a parameter's moments where its path ends in that parameter's
  path, with its shape, `other` for the rest (step counts). By path rather than optax.tree_map_params,
  which cannot pair a partitioned optimizer's masked-out leaves (Muon's) with the parameters' tree."""
  path_of = lambda path: tuple(map(str, path))
  moments = {path_of(path): (param.shape, sharding) for (path, param), sharding in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(moment_shardings))}

  def sharding(path, leaf):
    owner = next((moments[path_of(path[i:])] for i in range(len(path)) if path_of(path[i:]) in moments), None)
    return owner[1] if owner and owner[0] == leaf.shape else other

  return jax.tree_util.tree_map_with_path(sharding, opt_state)


def init_state(layout: Layout, seed: int) -> dict:
  """Fresh parameters and optimizer state, created directly in their shardings."""
  return state_from_params(layout, initial_params(layout, seed), seed)


def initial_params(layout: Layout, seed: int) -> dict:
  """Fresh parameters drawn from `seed`, created directly in their shardings."""
  return jax.jit(param_draw(layout, seed), out_shardings=layout.param_shardings)()


def param_draw(layout: Layout, seed: int) -> Callable[[], dict]:
  """The function, to trace under jit, that draws fresh parameters from `seed` in the state's dtypes (LoRA's
  frozen base may be narrower). Threefry is partitionable, so the values do not depend on the shardings the
  draw is compiled for."""

  def draw():
    with nnx.use_eager_sharding(False):
      params = nnx.to_pure_dict(nnx.state(build_model(layout.model, seed), nnx.Param))
    return jax.tree.map(lambda p, want: p.astype(want.dtype), params, layout.abstract_state["params"])

  return draw


def base_params(layout: Layout, pretrained, seed: int) -> dict:
  """The weights a run starts from: `pretrained`'s (an opened init_from checkpoint, or None) or fresh ones drawn
  from `seed`. A LoRA checkpoint leaves them out (they never change), and is restored with them."""
  return pretrained.load_params(layout) if pretrained is not None else initial_params(layout, seed)


def state_from_params(layout: Layout, params: dict, seed: int = 0) -> dict:
  """Step 0 around given parameters (already in their shardings, and donated): fresh optimizer state (and under
  LoRA fresh adapters, drawn from `seed`)."""
  return jax.jit(lambda p: _first_state(layout, p, seed), out_shardings=layout.state_shardings,
                 donate_argnums=0)(params)


def _first_state(layout: Layout, params: dict, seed: int) -> dict:
  trained = params
  if layout.lora:
    trained = lora.initial(layout.lora, layout.abstract_state["params"], layout.logical, seed)
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": layout.tx.init(trained),
           "skipped": jnp.zeros((), jnp.int32)}
  if layout.lora:
    state[lora.ADAPTERS] = trained
  if "reference" in layout.abstract_state:  # a copy: the parameters are updated in place
    state["reference"] = jax.tree.map(jnp.copy, params)
  if layout.initial_loss_scale is not None:
    state["loss_scale"] = loss_scale.initial(layout.initial_loss_scale)
  return state


def param_count(layout: Layout) -> int:
  return sum(x.size for x in jax.tree.leaves(layout.abstract_state["params"]))


def trained_count(layout: Layout) -> int:
  """Parameters the optimizer updates: all of them, or LoRA's adapters."""
  return sum(x.size for x in jax.tree.leaves(layout.abstract_state[lora.ADAPTERS if layout.lora else "params"]))


def active_param_count(layout: Layout) -> int:
  """Parameters each token computes with: all of a dense model's, the top-k experts' of a MoE one."""
  return param_count(layout) - layout.model.idle_expert_params


def abstract_inputs(layout: Layout, config, weighted: bool = False):
  """ShapeDtypeStructs carrying shardings for the state and one batch (with loss weights where `weighted`:
  the data has loss masks, its split's `mask`; preference pairs under objective=dpo; rollouts under
  objective=grpo)."""
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       layout.abstract_state, layout.state_shardings)
  if layout.preference is not None:
    entries = [(key, "int32") for key in preference.batch_keys()]
  elif layout.grpo is not None:
    entries = [(key, "int32" if key in ("inputs", "targets") else "float32") for key in grpo.FIELDS]
  else:
    entries = (("inputs", "int32"), ("targets", "int32"), *((("weights", "float32"),) if weighted else ()))
  batch = {name: jax.ShapeDtypeStruct((config.batch_size, layout.model.max_len), dtype, sharding=layout.batch_sharding)
           for name, dtype in entries}
  return state, batch
