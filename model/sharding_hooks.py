"""How the model marks its activations: logical names only.

The model never sees a mesh. It calls `constrain(x, ("batch", "length", "embed"))`
and whoever traces it (parallel/rules.py) may install a resolver that turns the
logical names into a sharding constraint. With no resolver installed the call is
the identity, so the model runs unchanged on one device.
"""

import contextlib
import contextvars
from typing import Callable

import jax

Resolver = Callable[[jax.Array, tuple], jax.Array]
_resolver: contextvars.ContextVar[Resolver | None] = contextvars.ContextVar("resolver", default=None)


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """Ask the installed resolver to shard `x` by its logical axis names."""
  resolve = _resolver.get()
  return x if resolve is None else resolve(x, logical_axes)


@contextlib.contextmanager
def activation_resolver(resolve: Resolver):
  token = _resolver.set(resolve)
  try:
    yield
  finally:
    _resolver.reset(token)
