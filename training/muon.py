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
  round_robin  the matrices of like shape and layout (every layer's q, k, v and
               output projection, say) are dealt over the group's n devices as
               one stack of c: an all-to-all brings each device ceil(c / n)
               whole matrices, it iterates on them, and one back returns the
               shards. A matrix with no like, or split on a side's minor axis
               (its merged shards would not be contiguous), is gathered.
  gathered     every device all-gathers the group's momentum, iterates on every
               matrix whole, and keeps its shard (Liu et al.'s Distributed Muon).
  partitioned  the partitioner splits the iteration's matmuls itself.
Round robin sends 2 ceil(c / n) / c of the gather's bytes for ceil(c / n) / c
of its FLOPs; docs/research.md#muon measures the three.
"""

import collections
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from model.hidden import matrix_sides
from parallel import rules
from parallel.costs import F32_BYTES, Weight, axes_key, gather, shard_elements, sharded_over
from parallel.mesh import EXPERT, PIPELINE

# Keller Jordan's quintic: its slope at zero is as steep as it can be while the singular values still land in
# about [0.7, 1.2] after five steps, which does not hurt training (modded-nanogpt).
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
ITERATIONS = ("round_robin", "gathered", "partitioned")
# Where a matrix's axes live while it is orthogonalised: only its batch axes stay split.
GATHERED_RULES = (("layers", PIPELINE), ("expert", EXPERT), ("vocab", None), ("heads", None), ("kv_heads", None),
                  ("mlp", None), ("head_dim", None), ("embed", None))


class Deal(NamedTuple):
  """A round robin's share: the local [M, N] shape of the matrices dealt together (sides oriented short first,
  each side's axes merged) and the mesh axes that split each side ((axis, 1) for M, (axis, 2) for N, a
  side's minor axis first: the order all-to-alls rebuild it in). Parameters with equal Deals are dealt as
  one stack."""
  shape: tuple[int, int]
  splits: tuple[tuple[str, int], ...]

  def devices(self, mesh_shape) -> int:
    """The group the matrices are dealt over."""
    return math.prod(mesh_shape[a] for a, _ in self.splits)

  def whole(self, mesh_shape) -> tuple[int, int]:
    """Each matrix's [M, N] once its sides are rebuilt."""
    return tuple(size * math.prod(mesh_shape[a] for a, side in self.splits if side == i)
                 for i, size in enumerate(self.shape, 1))


class Matrix(NamedTuple):
  """One Muon parameter: which of its axes are the matrices' input and output sides (the rest are batch
  axes); where its momentum is gathered for the iteration (None: where the partitioner puts it), where its
  update goes back to, and the Deal it joins where its matrices are dealt round robin instead."""
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  gathered: NamedSharding | None = None
  kept: NamedSharding | None = None
  deal: Deal | None = None


def matrices(params, logical, mesh=None, moment_rules=None, iteration: str = "round_robin") -> dict:
  """Each parameter's Matrix, or None where AdamW trains it. With a mesh, the shardings to gather each
  matrix's momentum in and to keep its update in (the moments' own, `moment_rules`), and under round robin
  the Deal each joins."""
  if iteration not in ITERATIONS:
    raise ValueError(f"optimizer.muon_iteration={iteration!r} is unknown; use one of {', '.join(ITERATIONS)}.")

  def describe(path, param, spec):
    spec = tuple(spec) + (None,) * (param.ndim - len(spec))
    sides = matrix_sides(path, spec)
    if sides is None or mesh is None or iteration == "partitioned":
      return sides and Matrix(*sides)
    return Matrix(*sides, NamedSharding(mesh, rules.spec(spec, GATHERED_RULES)),
                  NamedSharding(mesh, rules.spec(spec, moment_rules)))

  described = jax.tree_util.tree_map_with_path(describe, params, logical)
  if iteration != "round_robin" or mesh is None:
    return described
  found, tree = jax.tree.flatten(described, is_leaf=lambda m: m is None or isinstance(m, Matrix))
  shapes = [param.shape for param in jax.tree.leaves(params)]
  dealt = iter(deals([(shape, m.kept.spec, m) for shape, m in zip(shapes, found) if m], dict(mesh.shape)))
  return jax.tree.unflatten(tree, [m and m._replace(deal=next(dealt)) for m in found])


def batch_axes(matrix: Matrix, ndim: int) -> list[int]:
  return [i for i in range(ndim) if i not in matrix.inputs + matrix.outputs]


def _splitting(spec, mesh_shape: dict, axis: int) -> tuple[str, ...]:
  """The mesh axes of more than one device that split a parameter axis."""
  return tuple(a for a in rules.entry_axes(spec[axis]) if mesh_shape[a] > 1)


def oriented(matrix: Matrix, shape, spec, mesh_shape: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The matrix's sides, the shorter first, and of equal sides a split one: a transposed matrix is dealt with
  its like (the polar factor of a transpose is the transpose of the polar factor)."""
  key = lambda side: (math.prod(shape[i] for i in side), not any(_splitting(spec, mesh_shape, i) for i in side))
  return (matrix.inputs, matrix.outputs) if key(matrix.inputs) <= key(matrix.outputs) else (
      matrix.outputs, matrix.inputs)


def matrix_count(shape, spec, matrix: Matrix, mesh_shape: dict) -> int:
  """Matrices of the parameter on each device's stack: its batch axes' own splits (a stage's layers, an expert
  device's experts) are matrices the side-splitting devices do not share."""
  batch = batch_axes(matrix, len(shape))
  return math.prod(shape[i] for i in batch) // math.prod(mesh_shape[a] for i in batch for a in rules.entry_axes(spec[i]))


def _deal_of(shape, spec, matrix: Matrix, mesh_shape: dict) -> Deal | None:
  """The Deal a parameter laid out as `spec` would join, or None where no axis splits its sides or one splits
  a side's minor axis (merged, its shards would not be contiguous)."""
  splitting = lambda i: _splitting(spec, mesh_shape, i)
  local, splits = [], []
  for position, side in enumerate(oriented(matrix, shape, spec, mesh_shape), 1):
    if any(splitting(i) for i in side[1:]):
      return None
    splits += [(a, position) for a in reversed(splitting(side[0]))]
    local.append(math.prod(shape[i] for i in side) // math.prod(mesh_shape[a] for a in splitting(side[0])))
  return Deal(tuple(local), tuple(splits)) if splits else None


def deals(entries: list, mesh_shape: dict) -> list[Deal | None]:
  """Round robin's Deal for each (shape, spec, Matrix) of `entries`, or None where its matrices are gathered:
  a Deal of a single matrix would send it twice where gathering sends it once, for the same FLOPs."""
  found = [_deal_of(shape, spec, matrix, mesh_shape) for shape, spec, matrix in entries]
  count = collections.Counter()
  for deal, (shape, spec, matrix) in zip(found, entries):
    count[deal] += matrix_count(shape, spec, matrix, mesh_shape)
  return [deal if deal and count[deal] > 1 else None for deal in found]


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


def orthogonalize_dealt(xs: list, described: list, steps: int) -> list:
  """Newton-Schulz over the matrices of `xs`, parameters of one Deal, dealt over the devices that split
  their sides. Inside a map manual over the mesh, each device's shards of every matrix, one stack (padded
  with zero matrices, which stay zero, to a multiple of the group), go through one all-to-all per splitting
  axis, which trades a slice of the stack for the rest of each matrix; the device iterates on its whole
  matrices and the all-to-alls run back."""
  deal, mesh = described[0].deal, described[0].kept.mesh
  devices = deal.devices(mesh.shape)
  orders = [batch_axes(m, x.ndim) + [i for side in oriented(m, x.shape, m.kept.spec, dict(mesh.shape)) for i in side]
            for x, m in zip(xs, described)]

  def local(*shards):
    moved = [shard.transpose(order) for shard, order in zip(shards, orders)]
    stacks = [m.reshape((-1,) + deal.shape) for m in moved]
    stack = jnp.concatenate(stacks)
    count = stack.shape[0]
    # The barrier keeps the stack one array: XLA would otherwise slice the all-to-all's operand into its
    # concatenated parts, whose layouts differ, and the CPU compiler's verifier refuses the result.
    stack = jax.lax.optimization_barrier(jnp.pad(stack, [(0, -count % devices), (0, 0), (0, 0)]))
    for name, side in deal.splits:
      stack = jax.lax.all_to_all(stack, name, 0, side, tiled=True)
    stack = newton_schulz(stack, steps)
    for name, side in reversed(deal.splits):
      stack = jax.lax.all_to_all(stack, name, side, 0, tiled=True)
    pieces = jnp.split(stack[:count], list(itertools.accumulate(len(s) for s in stacks))[:-1])
    return tuple(piece.reshape(m.shape).transpose(sorted(range(m.ndim), key=order.__getitem__))
                 for piece, m, order in zip(pieces, moved, orders))

  specs = tuple(PartitionSpec(*m.kept.spec) for m in described)
  return list(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs)(*xs))


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
    out = [None] * len(leaves)
    by_deal = collections.defaultdict(list)
    for i, matrix in enumerate(described):
      if matrix.deal:
        by_deal[matrix.deal].append(i)
    for members in by_deal.values():
      dealt = orthogonalize_dealt([leaves[i] for i in members], [described[i] for i in members], steps)
      for i, x in zip(members, dealt):
        out[i] = x
    for i, (x, matrix) in enumerate(zip(leaves, described, strict=True)):
      if matrix.gathered is None:
        out[i] = orthogonalize(x, matrix, steps)
      elif not matrix.deal:
        # A map manual over every axis, so that the partitioner cannot split the iteration again: each device
        # iterates on whole matrices, then keeps its shard of the result.
        whole = jax.shard_map(lambda x: orthogonalize(x, matrix, steps), mesh=matrix.gathered.mesh,
                              in_specs=matrix.gathered.spec, out_specs=matrix.gathered.spec)(x)
        out[i] = jax.lax.with_sharding_constraint(whole, matrix.kept)
      out[i] = out[i] * rms * math.sqrt(max(fans(x, matrix)))
    return jax.tree.unflatten(tree, out), MomentumState(momentum)

  return optax.GradientTransformation(lambda params: MomentumState(jax.tree.map(jnp.zeros_like, params)), update)


def muon(opt, learning_rate, decays, described: dict) -> optax.GradientTransformation:
  """Muon (settings `opt`, config.optimizer) for the parameters `described` gives a Matrix, AdamW (decay where
  `decays`) for the rest."""
  is_matrix = lambda x: isinstance(x, Matrix) or x is None
  labels = jax.tree.map(lambda m: "adamw" if m is None else "muon", described, is_leaf=is_matrix)
  muon_leaves = [m for m in jax.tree.leaves(described, is_leaf=is_matrix) if m is not None]
  return optax.partition({
      "muon": optax.chain(scale_by_muon(muon_leaves, opt.muon_momentum, opt.muon_steps, opt.muon_rms),
                          optax.add_decayed_weights(opt.weight_decay),
                          optax.scale_by_learning_rate(learning_rate)),
      "adamw": optax.adamw(learning_rate, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay, mask=decays),
  }, labels)


def _iterated(opt, moments, mesh: dict, weights: list[Weight]) -> tuple[dict, list]:
  """How each matrix weight is orthogonalised whole under optimizer section `opt`, its moments laid out by
  the rules table `moments`: {Deal: matrices per device's stack} for round robin's deals, and (weight, the
  mesh axes its momentum is gathered over) for the rest. Nothing where the partitioner splits the iteration."""
  if opt.muon_iteration == "partitioned":
    return {}, []
  entries = [(w, (w.shape, tuple(rules.spec(w.axes, moments)) + (None,) * len(w.shape), Matrix(*w.sides)))
             for w in weights if w.sides]
  found = deals([entry for _, entry in entries], mesh) if opt.muon_iteration == "round_robin" else [None] * len(entries)
  dealt, gathered = collections.Counter(), []
  for (w, entry), deal in zip(entries, found):
    if deal:
      dealt[deal] += matrix_count(*entry, mesh)
    else:
      gathered.append((w, sharded_over(w, mesh, moments) - sharded_over(w, mesh, GATHERED_RULES)))
  return dealt, gathered


def sent(opt, moments, mesh: dict, weights: list[Weight]) -> dict[tuple[str, str], int]:
  """Bytes one device sends per step: the float32 momentum of each matrix its group splits, once. Dealt:
  each deal's stack, padded to a multiple of the group, crosses one all-to-all per splitting axis and one
  back. Gathered: all-gathered over the axes that split it, and the update sliced, not sent."""
  traffic = collections.Counter()
  dealt, gathered = _iterated(opt, moments, mesh, weights)
  for deal, count in dealt.items():
    devices = deal.devices(mesh)
    stack = -(-count // devices) * math.prod(deal.shape) * devices * F32_BYTES  # a device's padded stack
    for axis, _ in deal.splits:
      traffic[("all-to-all", axis)] += 2 * gather(stack, mesh[axis])
  for w, axes in gathered:
    if axes:
      whole = shard_elements(w, mesh, GATHERED_RULES) * F32_BYTES
      traffic[("all-gather", axes_key(axes))] += gather(whole, math.prod(mesh[a] for a in axes))
  return dict(traffic)


def newton_schulz_flops(opt, moments, mesh: dict, weights: list[Weight]) -> int:
  """Matmul FLOPs per device per step: ceil(count / devices) matrices of each deal, every matrix the device
  gathered. Per step of the quintic on an m x n matrix (m <= n): X X^T and (bA + cA^2) X, 2m^2 n each, and
  A^2, 2m^3."""
  quintic = lambda m, n: opt.muon_steps * (4 * m * m * n + 2 * m ** 3)
  dealt, gathered = _iterated(opt, moments, mesh, weights)
  total = 0
  for deal, count in dealt.items():
    total += -(-count // deal.devices(mesh)) * quintic(*sorted(deal.whole(mesh)))
  for w, _ in gathered:
    m, n = sorted(math.prod(w.shape[i] for i in side) for side in w.sides)
    total += shard_elements(w, mesh, GATHERED_RULES) // (m * n) * quintic(m, n)
  return total
