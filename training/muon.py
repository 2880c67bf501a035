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
split over devices. Each device gathers the momentum of the matrices its
shards belong to (over `data` and `tensor`; the batch axes stay split, so a
stage orthogonalises its own layers and an expert device its own experts),
iterates, and keeps its own shard: one all-gather of each matrix's momentum,
against 2 x 5 all-reduces of its m x m Gram matrix when the partitioner
splits the iteration's matmuls (docs/research.md#muon weighs the two).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from model.hidden import matrix_sides
from parallel import rules
from parallel.mesh import EXPERT, PIPELINE

# Keller Jordan's quintic: its slope at zero is as steep as it can be while the singular values still land in
# about [0.7, 1.2] after five steps, which does not hurt training (modded-nanogpt).
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
# Where a matrix's axes live while it is orthogonalised: only its batch axes stay split.
GATHERED_RULES = (("layers", PIPELINE), ("expert", EXPERT), ("vocab", None), ("heads", None), ("kv_heads", None),
                  ("mlp", None), ("head_dim", None), ("embed", None))


class Matrix(NamedTuple):
  """One Muon parameter: which of its axes are the matrices' input and output sides (the rest are batch
  axes), and where its momentum is gathered for the iteration and where its update goes back to."""
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  gathered: NamedSharding | None = None
  kept: NamedSharding | None = None


def matrices(params, logical, mesh=None, moment_rules=None) -> dict:
  """Each parameter's Matrix, or None where AdamW trains it. With a mesh, the shardings to gather each
  matrix's momentum in and to keep its update in (the moments' own, `moment_rules`)."""
  def describe(path, param, spec):
    sides = matrix_sides(path, tuple(spec) + (None,) * (param.ndim - len(spec)))
    if sides is None or mesh is None:
      return sides and Matrix(*sides)
    return Matrix(*sides, NamedSharding(mesh, rules.spec(tuple(spec), GATHERED_RULES)),
                  NamedSharding(mesh, rules.spec(tuple(spec), moment_rules)))

  return jax.tree_util.tree_map_with_path(describe, params, logical)


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
  batch = [i for i in range(x.ndim) if i not in matrix.inputs + matrix.outputs]
  order = batch + list(matrix.inputs) + list(matrix.outputs)
  moved = x.transpose(order)
  sizes = lambda axes: math.prod(x.shape[i] for i in axes)
  flat = moved.reshape(sizes(batch), sizes(matrix.inputs), sizes(matrix.outputs))
  return newton_schulz(flat, steps).reshape(moved.shape).transpose(sorted(range(x.ndim), key=order.__getitem__))


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
