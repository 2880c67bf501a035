"""One uint32 per state leaf that changes when any element's bits do, and is the same on any mesh.

A checkpoint's bytes can be damaged after the save (bit rot, a stray write) into values
that are still finite, which a finiteness check passes. Each element's bits, as unsigned
words, are weighted by a mix of the element's global flat index and summed with uint32
wrap-around: integer addition is exact and associative, so every sharding and reduction
order gives the same bits (also after restoring onto another mesh), and as every weight is
odd, a change to any one element always changes the sum.
"""

import jax
import jax.numpy as jnp


@jax.jit
def fingerprints(tree):
  """`tree` with each leaf replaced by its fingerprint, a uint32 scalar (one fused reduction each)."""
  def one(leaf):
    words = _words(leaf)
    return jnp.sum(words * _odd_weights(words.shape), dtype=jnp.uint32)
  return jax.tree.map(one, tree)


def _words(leaf) -> jax.Array:
  """The leaf's bits as uint32 words: narrower types widened, 64-bit ones split into two."""
  if leaf.dtype == jnp.bool_:
    return leaf.astype(jnp.uint32)
  bits = 8 * leaf.dtype.itemsize
  if bits >= 32:
    return jax.lax.bitcast_convert_type(leaf, jnp.uint32)
  return jax.lax.bitcast_convert_type(leaf, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)


def _odd_weights(shape) -> jax.Array:
  """An odd uint32 per element, mixed from its row-major global index (so swapped elements differ)."""
  index = jnp.uint32(0)
  for axis, size in enumerate(shape):
    index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
  mixed = index * jnp.uint32(0x9E3779B9)  # Fibonacci hashing: neighbouring indices land far apart
  return (mixed ^ (mixed >> 16)) | jnp.uint32(1)
