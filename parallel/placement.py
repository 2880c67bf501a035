"""The model's placement on a run's layout (model/placement.py): which rules pin its activations, which
strategies run its attention and experts, and how a kernel the partitioner cannot split runs."""

import dataclasses

from model.placement import Placement
from parallel import context, experts, rules
from parallel.layout import Layout
from parallel.mesh import EXPERT

# Decoding never shards `length`: each step sees one position, and the cache is
# read whole by every query. Batch, heads and vocabulary keep the training layout.
DECODE_RULES = tuple((name, None if name == "length" else axes) for name, axes in rules.ACTIVATION_RULES)


def for_layout(layout: Layout) -> Placement:
  """The train and eval steps': activations pinned by the rules, attention by the layout's context strategy,
  experts sharded over `expert` by all-to-all, a kernel the partitioner cannot split run per device."""
  mesh = layout.mesh
  return dataclasses.replace(
      _pinned(mesh, rules.ACTIVATION_RULES),
      attention=None if layout.context == "none" else context.strategy(layout.context, mesh),
      experts=experts.strategy(mesh) if mesh.shape[EXPERT] > 1 and layout.model.num_experts else None,
      per_device=context.per_device(mesh))


def for_stages(layout: Layout) -> Placement:
  """A pipeline stage's, inside the pipeline's map manual over `pipeline`, the batch's axes and `sequence`:
  for_layout's, with attention over a sharded sequence and the experts' all-to-alls run in that map rather
  than in maps of their own, and a MoE router given the whole sequence it ranks."""
  outer = for_layout(layout)
  sharded = layout.context != "none"
  return dataclasses.replace(outer, attention=context.in_map(layout.context) if sharded else None,
                             experts=experts.exchange if outer.experts else None,
                             whole_length=context.whole_length if sharded else outer.whole_length)


def for_decoding(layout: Layout) -> Placement:
  """Decoding's: activations pinned by DECODE_RULES, and experts sharded over `expert` by all-to-all as in
  the train step (left to the partitioner, the batch-sharded slots would be replicated and re-split by
  expert at every token); attention reads the cache."""
  return dataclasses.replace(_pinned(layout.mesh, DECODE_RULES), experts=for_layout(layout).experts)


def _pinned(mesh, table) -> Placement:
  """Activations pinned to `mesh` by the rules `table`, everything else local."""
  return Placement(resolve=lambda x, logical_axes: rules.constrain(x, mesh, logical_axes, table),
                   count=lambda logical_axis: rules.shard_count(mesh, logical_axis, table),
                   mean=lambda x, logical_axes: rules.shard_mean(x, logical_axes, table))
