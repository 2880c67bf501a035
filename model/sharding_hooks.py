"""How the model leaves placement to others: logical names and an attention hook.

The model never sees a mesh. It calls `constrain(x, ("batch", "length", "embed"))`
and whoever traces it (parallel/rules.py) may install a resolver that turns the
logical names into a sharding constraint; it calls `attention(...)` and
parallel/context.py may install a strategy that runs attention over a sharded
`length` (ring, Ulysses); a mixture-of-experts layer hands its expert
computation to an expert strategy (parallel/experts.py: all-to-all over
`expert`). With nothing installed all three are plain local math, so the
model runs unchanged on one device.
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


def activation_resolver(resolve: Resolver):
  """While tracing under this, `constrain` calls `resolve(x, logical_axes)`."""
  return _installed(_resolver, resolve)


Strategy = Callable[..., jax.Array]
_strategy: contextvars.ContextVar[Strategy | None] = contextvars.ContextVar("strategy", default=None)


def attention_strategy() -> Strategy | None:
  return _strategy.get()


def context_strategy(strategy: Strategy):
  """While tracing under this, attention calls `strategy(q, k, v, positions, block=...)` instead of local math."""
  return _installed(_strategy, strategy)


ExpertStrategy = Callable[..., jax.Array]
_experts: contextvars.ContextVar[ExpertStrategy | None] = contextvars.ContextVar("experts", default=None)


def expert_strategy() -> ExpertStrategy | None:
  return _experts.get()


def expert_parallelism(strategy: ExpertStrategy):
  """While tracing under this, MoE layers call `strategy(experts_fn, x_EBCD, weights)`."""
  return _installed(_experts, strategy)


@contextlib.contextmanager
def _installed(variable: contextvars.ContextVar, value):
  token = variable.set(value)
  try:
    yield
  finally:
    variable.reset(token)
