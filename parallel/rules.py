"""Logical axis names to mesh axes: one ordered table for weights, one for activations.

Weights and activations are looked up apart because under FSDP the weight axis
`embed` lives on `data` while an activation's `batch` already does; one table
would put `data` twice in a spec. Within a spec a mesh axis is used once: a
later logical axis that asks for an axis already taken stays unsharded.
"""

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR

ACTIVATION_RULES = (
    # Outside MoE layers expert devices act as data parallel. `expert` major: the expert
    # all-to-all (parallel/experts.py) then splits the batch as it already lies.
    ("batch", (EXPERT, DATA)),
    ("length", SEQUENCE),
    ("heads", TENSOR),
    ("kv_heads", TENSOR),
    ("mlp", TENSOR),
    ("vocab", TENSOR),
    ("expert", EXPERT),
    ("embed", None),
    ("head_dim", None),
    ("latent", None),  # latent attention's compressed queries and keys (model/mla.py)
)

BATCH_AXES = dict(ACTIVATION_RULES)["batch"]  # the mesh axes that split a batch's rows, for shard_map specs

_WEIGHT_RULES = (
    ("layers", PIPELINE),
    ("vocab", TENSOR),
    ("heads", TENSOR),
    ("kv_heads", TENSOR),
    ("mlp", TENSOR),
    ("expert", EXPERT),
    ("head_dim", None),
)

def fsdp_axis(sharding_config) -> str:
  """The axis ZeRO shards over: `data`, or under hybrid sharding (sharding.fsdp_group) the groups on
  `expert`, `data` then holding the replicas (parallel/mesh.py hybrid_shape)."""
  return EXPERT if sharding_config.fsdp_group else DATA

def weight_rules(zero: int, axis: str = DATA) -> tuple:
  """ZeRO-3 (FSDP) shards every weight's `embed` axis over `axis`, or its `latent` one where it has no `embed`
  (latent attention's up-projections); below that they are replicated."""
  return _WEIGHT_RULES + (("embed", axis if zero == 3 else None), ("latent", axis if zero == 3 else None))

def optimizer_rules(zero: int, axis: str = DATA) -> tuple:
  """ZeRO-1 and ZeRO-3 keep Adam's moments in the FSDP layout; ZeRO-0 mirrors the weights."""
  return weight_rules(3 if zero >= 1 else 0, axis)

def split_by_embed(rules) -> tuple:
  """`rules` for a stack that splits into unequal pipeline stages (parallel/stages.py): a mesh axis splits a
  dimension only into equal parts, so its layers stay whole and `pipeline` splits its `embed` axis instead,
  ahead of any ZeRO-3 split (the order in which the pipeline's gradients are scattered)."""
  moved = lambda name, axes: (None if name == "layers" else
                              (PIPELINE, *entry_axes(axes)) if name == "embed" else axes)
  return tuple((name, moved(name, axes)) for name, axes in rules)


def entry_axes(entry) -> tuple:
  """The mesh axes of one PartitionSpec entry (None, one axis name, or a tuple of them) as a tuple."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def as_entry(axes: tuple):
  """The PartitionSpec entry for a tuple of mesh axes: None, the one name, or the tuple."""
  return axes[0] if len(axes) == 1 else (axes or None)


def spec(logical_axes, rules) -> P:
  """The PartitionSpec for a tuple of logical names (None = unsharded)."""
  table = dict(rules)
  used, out = set(), []
  for name in logical_axes:
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no rule; add one to parallel/rules.py.")
    free = tuple(a for a in entry_axes(table[name]) if a not in used)
    used.update(free)
    out.append(as_entry(free))
  return P(*out)

def shardings(logical_tree, mesh, rules):
  """NamedShardings for a tree of logical PartitionSpecs (as `nnx.get_partition_spec` gives)."""
  return jax.tree.map(lambda p: NamedSharding(mesh, spec(tuple(p), rules)), logical_tree,
                      is_leaf=lambda x: isinstance(x, P))


def shard_count(mesh, logical_axis: str, rules=ACTIVATION_RULES) -> int:
  """How many shards `logical_axis` has on the mesh being traced: inside a shard_map, its manual axes
  are already split off (the map's body sees one shard of them)."""
  entry = spec((logical_axis,), rules)[0]
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  return math.prod(mesh.shape[a] for a in entry_axes(entry) if a not in manual)


def shard_mean(x, logical_axes, rules=ACTIVATION_RULES):
  """`x`, a mean over one shard of `logical_axes`, as the mean over all of them: averaged over the shards a
  shard_map being traced splits off (its manual axes; each shard holds as many rows), x itself outside one."""
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  axes = tuple(a for entry in spec(logical_axes, rules) for a in entry_axes(entry) if a in manual)
  return jax.lax.pmean(x, axes) if axes else x


def constrain(x, mesh, logical_axes, rules=ACTIVATION_RULES):
  """`x` pinned to the sharding its logical axes ask for, on the mesh being traced.

  Inside a shard_map the context mesh marks its manual axes (a pipeline stage's
  `pipeline`, `data` and `expert`): constraints there are stated on that mesh and
  name only its automatic axes, the manual ones being the map's own business.
  """
  context = jax.sharding.get_abstract_mesh()
  if context.empty:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(logical_axes, rules)))
  manual = set(context.manual_axes)
  target = P(*(as_entry(tuple(a for a in entry_axes(e) if a not in manual)) for e in spec(logical_axes, rules)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(context, target))

def named(mesh, *logical_axes) -> NamedSharding:
  """The sharding of an activation-like array (e.g. a batch) with these logical axes."""
  return NamedSharding(mesh, spec(logical_axes, ACTIVATION_RULES))

