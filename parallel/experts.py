"""Expert parallelism: experts sharded over `expert`, tokens sent to them and back with all-to-all.

The MoE layer lays its tokens out per expert, (E, batch, capacity, embed), with
the batch split over `data` x `expert` like every activation. Inside a
`shard_map`, one all-to-all over `expert` trades the batch split
for an expert split, so each device holds every token routed to its E/X
experts; the experts run; a second all-to-all trades back. `tensor` stays
under GSPMD inside, so the experts' hidden dimension is Megatron-sharded over
`tensor` as a dense MLP's is.

Dropless routing uses the same fixed-size format with C = T slots per expert
per sequence: an expert is chosen at most once per token, so no group can send
one expert more, and the all-to-all needs no sizes exchanged first. Its cost
is E T rows per sequence where k T are filled (E / k times the expert work of
the grouped matmuls that dropless runs without expert parallelism).

The map is manual over `data` too, each device's rows local: left to GSPMD,
an all-to-all along a dimension also split over `data` first gathers it over
`data`. The expert weights enter replicated over `data`, which under FSDP is
the all-gather of its weights that FSDP performs anyway.

A pipeline stage already runs in a map manual over `expert` and `data`
(parallel/pipeline.py), where no map over them can nest: there the experts
run `exchange`, the same two all-to-alls, on weights that entered the
pipeline's map split over `expert`.
"""

import jax
from jax.sharding import PartitionSpec as P

from parallel.costs import gather
from parallel.mesh import EXPERT
from parallel.rules import BATCH_AXES

_TOKENS = P(None, BATCH_AXES)  # (E, batch, capacity, embed): the batch as every activation splits it
_WEIGHTS = P(EXPERT)  # every expert weight leads with its expert axis


def strategy(mesh):
  """The function MoE layers call to run `experts(x_EBCD, *weights)` over the `expert` axis (model/placement.py)."""

  def run(experts, x_EBCD, weights):
    return jax.shard_map(lambda x_EBCD, *local_weights: exchange(experts, x_EBCD, local_weights), mesh=mesh,
                         in_specs=(_TOKENS,) + (_WEIGHTS,) * len(weights), out_specs=_TOKENS,
                         axis_names=set(BATCH_AXES))(x_EBCD, *weights)

  return run


def exchange(experts, x_EBCD, local_weights):
  """Inside a map manual over `expert`: this device's tokens to their experts' devices, each device's E/X experts
  (`local_weights`) on what it receives, and the outputs back."""
  x_eBCD = jax.lax.all_to_all(x_EBCD, EXPERT, split_axis=0, concat_axis=1, tiled=True)
  y_eBCD = experts(x_eBCD, *local_weights)
  return jax.lax.all_to_all(y_eBCD, EXPERT, split_axis=1, concat_axis=0, tiled=True)


CALLS = 2  # all-to-alls per MoE layer and pass: to the experts and back


def sent(slot_bytes: int, experts: int) -> dict[tuple[str, str], int]:
  """Bytes one device sends per MoE layer and pass over `experts` devices, `slot_bytes` its (E, batch,
  capacity, embed) slots in the compute dtype: to their experts and back."""
  return {("all-to-all", EXPERT): CALLS * gather(slot_bytes, experts)}
