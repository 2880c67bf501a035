"""U-net skips across the stack (model.unet_skips; the modded-nanogpt speedrun's, after the U-Net's encoder-decoder
links): the first half of the units keep their outputs, and unit j of the second half adds to its input the
output of unit H-1-j times a learned weight that starts at 1. Early features reach the late layers, and the
gradient the early layers, without crossing the layers between.

The stack then runs as two scans (`in_halves`), the first returning its outputs, the second taking them reversed,
one per unit, beside its parameters: a single scan would have to carry all H outputs through every step, and its
backward pass would keep that carry once per step.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import ones

UNET = "unet"  # the model's attribute holding the skips' weights


class SkipWeights(nnx.Module):
  """One weight per skip, each starting at 1 (a vector: no weight decay, AdamW under Muon)."""

  def __init__(self, units: int):
    self.scale = ones((units // 2,), (None,))


def in_halves(run, x_BTD, blocks, per_unit, weights_H):
  """(output, each unit's ys) of the stacked `blocks` run as two halves with skips between them.

  `per_unit` is a tree of arrays with a leading axis of one entry per unit (the units' indices, their caches);
  `run(x_BTD, blocks, per_unit, skips, keep_outputs)` runs the units it is given (`blocks` holding as many) in order
  and returns (x_BTD, ys), or with keep_outputs (x_BTD, ys, each unit's output stacked); `skips` is None or, per
  unit, (an earlier output, its weight) for with_skip.
  """
  half = weights_H.shape[0]
  graphdef, state = nnx.split(blocks)

  def run_part(x_BTD, units, skips, keep_outputs):
    state_part, per_unit_part = jax.tree.map(lambda a: a[units], (state, per_unit))
    return run(x_BTD, nnx.merge(graphdef, state_part), per_unit_part, skips, keep_outputs)

  x_BTD, ys_first, outputs_HBTD = run_part(x_BTD, slice(None, half), None, True)
  x_BTD, ys_second = run_part(x_BTD, slice(half, None), (outputs_HBTD[::-1], weights_H), False)
  return x_BTD, jax.tree.map(lambda first, second: jnp.concatenate([first, second]), ys_first, ys_second)


def with_skip(x_BTD, skip):
  """A unit's input with its skip added: `skip` is (the first half's output, its weight), or None for none."""
  if skip is None:
    return x_BTD
  earlier_BTD, weight = skip
  return x_BTD + (weight * earlier_BTD).astype(x_BTD.dtype)
