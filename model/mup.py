"""muP (Yang et al., "Tensor Programs V", 2021): a width-W model parametrised so that a learning rate tuned
at a base width `model.mup_base_width` carries over, its activations and updates the same size per
coordinate whatever W.

With m = W / base width, relative to the standard parametrisation at the base width, for Adam:
- hidden matrices (model/hidden.py: both sides grow with W): initial std / sqrt(m) (variance 1/fan_in) and
  learning rate / m, so that each update moves a layer's output by the same amount however many inputs it sums;
- the head: initial std / sqrt(m), and the logits multiplied by 1 / m (ModelConfig.output_multiplier); its
  learning rate is the base one, as is a tied GPT-2 table's, which is also the embedding;
- embeddings, norms and biases: as at the base width.
Widths differ in their number of heads at one head width, so attention's 1/sqrt(head width) is muP's
1/head width up to a constant, and the MLP grows with the width.
"""

import math

import jax
from flax import nnx

from model.hidden import matrix_sides


def _shrinks_at_init(path, spec) -> bool:
  """Whether a parameter's initial values scale as 1/sqrt(m): the hidden matrices and Llama's untied head."""
  keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  return keys == ["head"] or matrix_sides(path, tuple(spec)) is not None


def scale_initialization(model: nnx.Module) -> nnx.Module:
  """`model` with its hidden matrices' and head's initial values divided by sqrt(m); unchanged without muP."""
  multiplier = model.cfg.width_multiplier
  if multiplier == 1:
    return model
  state = nnx.state(model, nnx.Param)
  logical = nnx.to_pure_dict(nnx.get_partition_spec(state))
  scaled = jax.tree_util.tree_map_with_path(
      lambda path, value, spec: value / math.sqrt(multiplier) if _shrinks_at_init(path, spec) else value,
      nnx.to_pure_dict(state), logical)
  nnx.replace_by_pure_dict(state, scaled)
  nnx.update(model, state)
  return model


def learning_rate_factors(params, logical, multiplier: float):
  """Each parameter's learning rate over the base one: 1 / m for the hidden matrices, 1 for the rest."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _, spec: 1 / multiplier if matrix_sides(path, tuple(spec)) is not None else 1.0, params, logical)
