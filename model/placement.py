"""Where the model's computation runs: one frozen Placement that the model reads and never builds.

The model never sees a mesh. It marks activations with logical names,
`constrain(x, ("batch", "length", "embed"))`, asks `shard_count("batch")` how
many shards an axis has, turns a statistic of the rows it holds into one of the
whole batch with `shard_mean(x, "batch", "length")` (inside a pipeline stage
it holds one shard of them), and reads the current Placement at the few points
that need hand-written collectives: attention over a sharded `length` (ring,
Ulysses), the experts of a mixture-of-experts layer (all-to-all over
`expert`), and attention kernels the partitioner cannot split.
parallel/placement.py builds the Placement from the run's layout; whoever
traces the model installs it with `placed` around the whole trace (the body of
a vmap may install a derived one, `Placement.placing_outside`). It is one value
for a whole program, the same in every block, which is why it is read from
context rather than passed through every module call and every nnx.scan, vmap
and remat between the step and a block. What differs per call is an argument
instead: decoding hands each block its layer's key/value cache. With nothing
installed the default Placement is plain local math on one device.
"""

import contextlib
import contextvars
import dataclasses
from typing import Callable

import jax


def _unconstrained(x: jax.Array, logical_axes: tuple) -> jax.Array:
  del logical_axes
  return x


def _one_shard(logical_axis: str) -> int:
  del logical_axis
  return 1


def _whole(x: jax.Array, logical_axes: tuple) -> jax.Array:
  del logical_axes
  return x


def _as_is(kernel: Callable, *arrays: jax.Array) -> jax.Array:
  return kernel(*arrays)


def _already_whole(x_BTX: jax.Array, positions_T: jax.Array):
  return x_BTX, positions_T, lambda y_BTX: y_BTX


@dataclasses.dataclass(frozen=True)
class Placement:
  """Everything the model leaves to whoever places it; the defaults run on one device."""
  # x pinned to the sharding its logical axes ask for (None = unsharded)
  resolve: Callable[[jax.Array, tuple], jax.Array] = _unconstrained
  # into how many shards a logical axis is split here
  count: Callable[[str], int] = _one_shard
  # `mean(x, logical_axes)`: x, a mean over the part of those axes the model holds here, as the mean over all of
  # them (averaged over their shards where it holds one: inside a map manual over them)
  mean: Callable[[jax.Array, tuple], jax.Array] = _whole
  # attention over a sharded `length`, `attention(q, k, v, positions, block=...)`; None: a local kernel
  attention: Callable[..., jax.Array] | None = None
  # `experts(run, x_EBCD, weights)`: a MoE layer's `run(x_EBCD, *weights)` over sharded experts; None: locally
  experts: Callable[..., jax.Array] | None = None
  # `per_device(kernel, q, k, v, *per_row)`: a kernel the partitioner cannot split (Pallas), on each device's share
  per_device: Callable[..., jax.Array] = _as_is
  # `whole_length(x_BTX, positions_T) -> (x, positions, local)`: the whole sequence where the model holds one
  # shard of it (inside a map manual over the length's axis), and `local(y_BTX)`, this shard's part of a result
  whole_length: Callable = _already_whole
  # logical axes an enclosing vmap's mapped axis already carries: `constrain` leaves them unsharded
  outside: frozenset = frozenset()

  def placing_outside(self, *logical_axes: str) -> "Placement":
    """This placement for the body of a vmap whose mapped axis carries `logical_axes` (the mapped axis
    itself is left to the partitioner)."""
    return dataclasses.replace(self, outside=self.outside | frozenset(logical_axes))


_current: contextvars.ContextVar[Placement] = contextvars.ContextVar("placement", default=Placement())


def current() -> Placement:
  """The placement installed where the model is being traced (the default outside any)."""
  return _current.get()


@contextlib.contextmanager
def placed(placement: Placement):
  """While tracing under this, the model reads `placement`."""
  token = _current.set(placement)
  try:
    yield
  finally:
    _current.reset(token)


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """`x` sharded by its logical axis names, as the current placement resolves them."""
  placement = current()
  return placement.resolve(x, tuple(None if name in placement.outside else name for name in logical_axes))


def shard_mean(x: jax.Array, *logical_axes: str) -> jax.Array:
  """`x`, a mean over the part of `logical_axes` held here, as the mean over all of them (x itself on one device)."""
  return current().mean(x, logical_axes)


def shard_count(logical_axis: str) -> int:
  """Into how many shards the current placement splits `logical_axis` here (1 on one device)."""
  return current().count(logical_axis)
