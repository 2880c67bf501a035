"""Split a batch into micro-batches without moving data between devices."""

import jax.numpy as jnp

from parallel import rules


def split(x_B, count: int, mesh):
  """[B, ...] -> [count, B / count, ...]: micro-batch i takes rows i, i + count, i + 2 count, ...

  Strided rows mean every data-parallel shard holds an equal part of every
  micro-batch, so the split is a local reshape, not a collective. A [B] array (one figure per row, such as a
  preference pair's reference log-probabilities) splits as its rows do.
  """
  x_bkX = x_B.reshape(x_B.shape[0] // count, count, *x_B.shape[1:])
  x_kbX = jnp.swapaxes(x_bkX, 0, 1)
  return rules.constrain(x_kbX, mesh, (None, "batch", "length", *(None,) * (x_B.ndim - 2))[:x_kbX.ndim])
