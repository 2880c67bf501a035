"""Muon: the layers' matrices step along their momentum orthogonalised by Newton-Schulz; the rest by AdamW.

Muon (Jordan et al. 2024, modded-nanogpt) replaces each hidden matrix's update
by the nearest semi-orthogonal matrix to its Nesterov momentum, found by five
steps of a quintic Newton-Schulz iteration. As Liu et al. ("Muon is Scalable
for LLM Training", 2025) do, the result is scaled by rms x sqrt(max(fan_in,
fan_out)), so that its RMS is AdamW's (about 0.2) and one learning rate and
one decoupled weight decay serve both groups.

The matrices are the layers' hidden matrices (model/hidden.py): each layer's,
expert's and GPT-2 projection's kernel is a matrix of its own. Embeddings, the
head, norms, biases, the MoE router and a shared expert's gate (a matrix with
one output) stay with AdamW.

The iteration needs each whole matrix, which ZeRO-1/3 and tensor parallelism
split over devices (the group of a matrix: the devices over `data` and
`tensor` that hold its shards; the batch axes stay split, so a stage
orthogonalises its own layers and an expert device its own experts).
optimizer.muon_iteration says how the group runs it:
  round_robin  a parameter's c matrices (its layers, experts) are dealt over the
               group's n devices: an all-to-all brings each device ceil(c / n)
               whole matrices, it iterates on them, and one back returns the
               shards. A parameter holding one matrix is gathered instead.
  gathered     every device all-gathers the group's momentum, iterates on every
               matrix whole, and keeps its shard (Liu et al.'s Distributed Muon).
  partitioned  the partitioner splits the iteration's matmuls itself.
Round robin sends 2 ceil(c / n) / c of the gather's bytes for 1 / n of its
FLOPs where c >= n; docs/research.md#muon measures the three.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from model.hidden import matrix_sides
from parallel import rules
from parallel.mesh import EXPERT, PIPELINE

# Keller Jordan's quintic: its slope at zero is as steep as it can be while the singular values still land in
# about [0.7, 1.2] after five steps, which does not hurt training (modded-nanogpt).
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
ITERATIONS = ("round_robin", "gathered", "partitioned")
# Where a matrix's axes live while it is orthogonalised: only its batch axes stay split.
GATHERED_RULES = (("layers", PIPELINE), ("expert", EXPERT), ("vocab", None), ("heads", None), ("kv_heads", None),
                  ("mlp", None), ("head_dim", None), ("embed", None))


class Matrix(NamedTuple):
  """One Muon parameter: which of its axes are the matrices' input and output sides (the rest are batch
  axes); where its momentum is gathered for the iteration (None: where the partitioner puts it), where its
  update goes back to, and whether its matrices are dealt round robin over their group instead."""
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  gathered: NamedSharding | None = None
  kept: NamedSharding | None = None
  dealt: bool = False


def matrices(params, logical, mesh=None, moment_rules=None, iteration: str = "round_robin") -> dict:
  """Each parameter's Matrix, or None where AdamW trains it. With a mesh, the shardings to gather each
  matrix's momentum in and to keep its update in (the moments' own, `moment_rules`)."""
  if iteration not in ITERATIONS:
    raise ValueError(f"optimizer.muon_iteration={iteration!r} is unknown; use one of {', '.join(ITERATIONS)}.")

  def describe(path, param, spec):
    spec = tuple(spec) + (None,) * (param.ndim - len(spec))
    sides = matrix_sides(path, spec)
    if sides is None or mesh is None or iteration == "partitioned":
      return sides and Matrix(*sides)
    kept = rules.spec(spec, moment_rules)
    matrix = Matrix(*sides, NamedSharding(mesh, rules.spec(spec, GATHERED_RULES)), NamedSharding(mesh, kept))
    return matrix._replace(dealt=iteration == "round_robin" and deals(param.shape, kept, matrix, dict(mesh.shape)))

  return jax.tree_util.tree_map_with_path(describe, params, logical)


def batch_axes(matrix: Matrix, ndim: int) -> list[int]:
  return [i for i in range(ndim) if i not in matrix.inputs + matrix.outputs]


def side_splits(matrix: Matrix, spec) -> list[tuple[str, int]]:
  """(mesh axis, parameter axis) for each mesh axis that splits a matrix side in `spec` (as long as the
  parameter's rank); an axis split over several mesh axes lists its minor one first, the order all-to-alls
  rebuild it in."""
  return [(a, i) for i in matrix.inputs + matrix.outputs for a in reversed(rules.entry_axes(spec[i]))]


def group(shape, spec, matrix: Matrix, mesh_shape: dict) -> tuple[int, int]:
  """(the devices that split each of a parameter's matrices, how many matrices those devices share) where the
  parameter lies as `spec`; the batch axes' own splits (a stage's layers, an expert device's experts) are
  matrices the group does not share."""
  devices = math.prod(mesh_shape[a] for a, _ in side_splits(matrix, spec))
  batch = batch_axes(matrix, len(shape))
  split = math.prod(mesh_shape[a] for i in batch for a in rules.entry_axes(spec[i]))
  return devices, math.prod(shape[i] for i in batch) // split


def deals(shape, spec, matrix: Matrix, mesh_shape: dict) -> bool:
  """Whether round robin deals the parameter's matrices: where a group shares more than one. Dealing a lone
  matrix would send it twice where gathering it sends it once, for the same FLOPs."""
  devices, shared = group(shape, spec, matrix, mesh_shape)
  return devices > 1 and shared > 1


def newton_schulz(x_BMN, steps: int, eps: float = 1e-7):
  """The orthogonal polar factor of each [M, N] matrix, approximately: five quintic steps from x / ||x||_F."""
  wide = x_BMN.shape[-2] <= x_BMN.shape[-1]  # iterate on the wide orientation: its Gram matrix is the smaller
  x = x_BMN if wide else jnp.swapaxes(x_BMN, -1, -2)
  x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
  a, b, c = NEWTON_SCHULZ
  for _ in range(steps):
    gram = x @ jnp.swapaxes(x, -1, -2)
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x if wide else jnp.swapaxes(x, -1, -2)


def orthogonalize(x, matrix: Matrix, steps: int):
  """Newton-Schulz over each matrix `x` holds, its batch axes kept."""
  batch = batch_axes(matrix, x.ndim)
  order = batch + list(matrix.inputs) + list(matrix.outputs)
  moved = x.transpose(order)
  sizes = lambda axes: math.prod(x.shape[i] for i in axes)
  flat = moved.reshape(sizes(batch), sizes(matrix.inputs), sizes(matrix.outputs))
  return newton_schulz(flat, steps).reshape(moved.shape).transpose(sorted(range(x.ndim), key=order.__getitem__))


def orthogonalize_dealt(x, matrix: Matrix, steps: int):
  """Newton-Schulz over `x`'s matrices, dealt over the devices that split their sides: inside a map manual
  over the mesh, each device's stack of matrix shards (padded with zero matrices, which stay zero, to a
  multiple of the group) goes through one all-to-all per splitting axis, which trades a slice of the stack
  for the rest of each matrix; the device iterates on its whole matrices and the all-to-alls run back."""
  kept, batch = matrix.kept, batch_axes(matrix, x.ndim)
  order = batch + list(matrix.inputs) + list(matrix.outputs)
  # A side's place once the batch axes are one: behind it, in `order`.
  place = {axis: 1 + order.index(axis) - len(batch) for axis in matrix.inputs + matrix.outputs}
  splits = [(name, place[axis]) for name, axis in side_splits(matrix, kept.spec)]
  devices = math.prod(kept.mesh.shape[name] for name, _ in splits)
  sides = Matrix(tuple(range(1, 1 + len(matrix.inputs))),
                 tuple(range(1 + len(matrix.inputs), 1 + len(matrix.inputs) + len(matrix.outputs))))

  def local(shard):
    moved = shard.transpose(order)
    stack = moved.reshape((-1,) + moved.shape[len(batch):])
    count = stack.shape[0]
    stack = jnp.pad(stack, [(0, -count % devices)] + [(0, 0)] * (stack.ndim - 1))
    for name, axis in splits:
      stack = jax.lax.all_to_all(stack, name, 0, axis, tiled=True)
    stack = orthogonalize(stack, sides, steps)
    for name, axis in reversed(splits):
      stack = jax.lax.all_to_all(stack, name, axis, 0, tiled=True)
    return stack[:count].reshape(moved.shape).transpose(sorted(range(x.ndim), key=order.__getitem__))

  spec = PartitionSpec(*kept.spec)
  return jax.shard_map(local, mesh=kept.mesh, in_specs=spec, out_specs=spec)(x)


def fans(x, matrix: Matrix) -> tuple[int, int]:
  return math.prod(x.shape[i] for i in matrix.inputs), math.prod(x.shape[i] for i in matrix.outputs)


class MomentumState(NamedTuple):
  momentum: optax.Updates


def scale_by_muon(described: list, beta: float, steps: int, rms: float) -> optax.GradientTransformation:
  """Nesterov momentum, orthogonalised and scaled to RMS `rms`; `described` holds the Matrix of each leaf this
  transform sees, in tree order (optax.partition hands it the Muon parameters alone)."""

  def update(grads, state, params=None):
    del params
    momentum = jax.tree.map(lambda m, g: beta * m + g, state.momentum, grads)
    nesterov = jax.tree.map(lambda m, g: beta * m + g, momentum, grads)
    leaves, tree = jax.tree.flatten(nesterov)
    out = []
    for x, matrix in zip(leaves, described, strict=True):
      scale = rms * math.sqrt(max(fans(x, matrix)))
      if matrix.gathered is None:
        out.append(orthogonalize(x, matrix, steps) * scale)
        continue
      if matrix.dealt:
        out.append(orthogonalize_dealt(x, matrix, steps) * scale)
        continue
      # A map manual over every axis, so that the partitioner cannot split the iteration again: each device
      # iterates on whole matrices, then keeps its shard of the result.
      whole = jax.shard_map(lambda x: orthogonalize(x, matrix, steps), mesh=matrix.gathered.mesh,
                            in_specs=matrix.gathered.spec, out_specs=matrix.gathered.spec)(x)
      out.append(jax.lax.with_sharding_constraint(whole * scale, matrix.kept))
    return jax.tree.unflatten(tree, out), MomentumState(momentum)

  return optax.GradientTransformation(lambda params: MomentumState(jax.tree.map(jnp.zeros_like, params)), update)


def muon(config, learning_rate, decays, described: dict) -> optax.GradientTransformation:
  """Muon for the parameters `described` gives a Matrix, AdamW (decay where `decays`) for the rest."""
  opt = config.optimizer
  is_matrix = lambda x: isinstance(x, Matrix) or x is None
  labels = jax.tree.map(lambda m: "adamw" if m is None else "muon", described, is_leaf=is_matrix)
  muon_leaves = [m for m in jax.tree.leaves(described, is_leaf=is_matrix) if m is not None]
  return optax.partition({
      "muon": optax.chain(scale_by_muon(muon_leaves, opt.muon_momentum, opt.muon_steps, opt.muon_rms),
                          optax.add_decayed_weights(opt.weight_decay),
                          optax.scale_by_learning_rate(learning_rate)),
      "adamw": optax.adamw(learning_rate, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay, mask=decays),
  }, labels)
