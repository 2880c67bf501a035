"""The scanned stack of blocks: its units, how they are stacked on a leading `layers` axis, and how they run.

A unit is one block, or with moe.every > 1 a Unit of several; `stacked` builds any number of them with their
parameters vmapped onto `layers`, and `scan_blocks` runs them in order under the configured remat policy.
model/transformer.py's LanguageModel holds such stacks; a pipeline stage runs its share of one.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from model import unet, value_embeds
from model.attention import ATTENTION_OUT
from model.config import ModelConfig
from model.placement import constrain

ACTIVATION_AXES = ("batch", "length", "embed")
STACKED = "blocks"  # the parameters stacked on a leading `layers` axis, which pipelines split into stages
DENSE_STACKED = "dense_blocks"  # moe.first_dense's dense layers, a stack of their own run before STACKED
BLOCK_INPUT = "block_input"  # the name full_offload moves to host memory


def _offloaded(*names):
  """A policy that keeps nothing on the device: `names` wait in host memory until the backward pass."""
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src="device", offload_dst="pinned_host")


CHECKPOINT_POLICIES = {  # model.remat: what the backward pass keeps rather than recomputes
    "full": None,  # nothing: the whole block is recomputed
    # as full, and each block's input (what full still keeps per layer) parked in host memory:
    # the device holds one layer's activations whatever the depth (MaxText's offloaded decoder inputs)
    "full_offload": _offloaded(BLOCK_INPUT),
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the weight matmuls' outputs
    "save_attention": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT),  # attention's output
    "offload": _offloaded(ATTENTION_OUT),  # attention's output, in host memory until the backward pass
}


class Unit(nnx.Module):
  """moe_every consecutive blocks, the last with a mixture-of-experts feed-forward layer.

  Scanning wants identical units, so a model whose every k-th layer is MoE scans over k-tuples of blocks
  rather than over single blocks.
  """

  def __init__(self, block_class, cfg: ModelConfig, rngs: nnx.Rngs):
    last = cfg.layers_per_unit - 1
    self.layers = nnx.List([block_class(cfg, rngs, moe=i == last) for i in range(cfg.layers_per_unit)])

  def __call__(self, x_BTD, positions_T, segments_BT=None):
    for layer in self.layers:
      x_BTD, stats = layer(x_BTD, positions_T, segments_BT)
    return x_BTD, stats  # the last layer's: the MoE one


def layer_kinds(cfg: ModelConfig, units_L=None) -> dict:
  """What a block needs to know of its place in the stack, as keyword arguments for the units `units_L` (the
  stack's own order when None), each a per-unit array for a scan: with model.global_every, `global_layer`,
  whether the layer attends over the whole causal context (model/attention.py `attention`); with
  model.value_embeds, the layer's table (model/value_embeds.py, which block_kinds turns into rows)."""
  units_L = jnp.arange(cfg.num_units) if units_L is None else units_L
  kinds = {}
  if cfg.global_every:
    kinds["global_layer"] = jnp.asarray(cfg.global_layers)[units_L]
  if cfg.value_embeds:
    kinds[value_embeds.TABLE] = jnp.asarray(value_embeds.layer_tables(cfg))[units_L]
  return kinds


def dense_layers_config(cfg: ModelConfig) -> ModelConfig:
  """The config moe.first_dense's dense layers run with: no experts, their own MLP width."""
  return dataclasses.replace(cfg, num_experts=0, moe_first_dense=0, moe_dense_width=0,
                             mlp_dim=cfg.moe_dense_width or cfg.mlp_dim)


def stacked(block_class, cfg: ModelConfig, rngs: nnx.Rngs, units: int | None = None):
  """One unit (a block, or a Unit of several) whose every parameter has a leading `layers` axis of size `units`
  (num_units when None)."""
  return stack_of(lambda rngs: Unit(block_class, cfg, rngs) if cfg.num_experts else block_class(cfg, rngs),
                  rngs, units or cfg.num_units)


def stack_of(make_unit, rngs: nnx.Rngs, count: int):
  """make_unit(rngs) once, every parameter with a leading `layers` axis holding `count` independent draws."""

  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return make_unit(rngs)

  return make(rngs)


def scan_blocks(blocks, x_BTD, positions_T, cfg: ModelConfig, segments_BT=None, live_L=None, units_L=None, *,
                value_rows=None, skips=None, keep_outputs=False):
  """Run the stacked units in order with nnx.scan, under the configured remat policy.

  Returns the output and each unit's router statistics stacked on a leading axis ({} when dense), and with
  `keep_outputs` each unit's output stacked as well (what model/unet.py's second half adds back; `skips`, one
  per unit, is what it adds). With `live_L`, a unit where it is False is skipped (lax.cond: no work), its
  statistics zero: the slots beyond a shorter pipeline chunk's units (parallel/stages.py). `units_L` says which
  of the model's units the stacked ones are (a pipeline stage's share, a U-net half; layer_kinds), the whole
  stack in order when None. `value_rows` are model.value_embeds' rows for the tokens (LanguageModel.value_rows).
  """

  def apply_block(x_BTD, block, positions_T, segments_BT, value_rows, kinds, skip):
    # Named so that every use inside the block reads the named value: under full_offload the
    # host copy is then the block's only residual, and the device copy dies with the forward pass.
    x_BTD = checkpoint_name(unet.with_skip(x_BTD, skip), BLOCK_INPUT)
    x_BTD, stats = block(x_BTD, positions_T, segments_BT, **value_embeds.block_kinds(kinds, value_rows))
    x_BTD = constrain(x_BTD, ACTIVATION_AXES)
    return x_BTD, ((stats, x_BTD) if keep_outputs else stats)

  if cfg.remat != "none":
    apply_block = nnx.remat(apply_block, policy=CHECKPOINT_POLICIES[cfg.remat], prevent_cse=False)
  kinds_L = layer_kinds(cfg, units_L)
  live = () if live_L is None else (live_L,)
  if live:
    apply_block = _unless_dead(apply_block)
  if cfg.scan_layers:
    scanned = nnx.scan(apply_block, in_axes=(nnx.Carry, 0, None, None, None, 0, 0, *[0] * len(live)),
                       out_axes=(nnx.Carry, 0))
    x_BTD, ys = scanned(x_BTD, blocks, positions_T, segments_BT, value_rows, kinds_L, skips, *live)
  else:
    # Unrolled: each unit's parameters sliced off the stack. The scan writes each layer's residuals into
    # buffers stacked over the layers, slice by slice; straight-line code can keep them as separate arrays
    # (whether that is faster on a GPU is unmeasured: BENCHMARKS.md's history).
    per_unit = []
    for unit in range(jax.tree.leaves(nnx.state(blocks))[0].shape[0]):
      at_unit = lambda tree: jax.tree.map(lambda a_L: a_L[unit], tree)
      x_BTD, unit_ys = apply_block(x_BTD, unit_of(blocks, unit), positions_T, segments_BT, value_rows,
                                   at_unit(kinds_L), at_unit(skips), *(l_L[unit] for l_L in live))
      per_unit.append(unit_ys)
    ys = jax.tree.map(lambda *units: jnp.stack(units), *per_unit)
  return (x_BTD, *ys) if keep_outputs else (x_BTD, ys)


def unit_of(stacked_module, index: int):
  """Unit `index` of a stacked module (`stack_of`), its parameters sliced off the leading `layers` axis."""
  graphdef, state = nnx.split(stacked_module)
  return nnx.merge(graphdef, jax.tree.map(lambda p: p[index], state))


def _unless_dead(apply_block):
  """apply_block taking a `live` flag last: the block where it is True; where False (lax.cond: no work)
  the input passed on and zero statistics."""
  def apply(x_BTD, block, positions_T, segments_BT, value_rows, kinds, skip, live):
    graphdef, state = nnx.split(block)
    run = lambda x_BTD, state: apply_block(x_BTD, nnx.merge(graphdef, state), positions_T, segments_BT, value_rows,
                                           kinds, skip)
    dead = lambda x_BTD, state: (x_BTD, jax.tree.map(_zeros_as, jax.eval_shape(run, x_BTD, state)[1]))
    return jax.lax.cond(live, run, dead, x_BTD, state)
  return apply


def _zeros_as(shape: jax.ShapeDtypeStruct):
  """Zeros of `shape`, varying over the manual axes it varies over inside a shard_map (lax.cond's branches
  must agree on them)."""
  varying = tuple(shape.manual_axis_type.varying)
  zeros = jnp.zeros(shape.shape, shape.dtype)
  return jax.lax.pcast(zeros, varying, to="varying") if varying else zeros
