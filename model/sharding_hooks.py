"""How the model leaves placement to others: logical names and an attention hook.

The model never sees a mesh. It calls `constrain(x, ("batch", "length", "embed"))`
and whoever traces it (parallel/rules.py) may install a resolver that turns the
logical names into a sharding constraint; it calls `attention(...)` and
parallel/context.py may install a strategy that runs attention over a sharded
`length` (ring, Ulysses); a mixture-of-experts layer hands its expert
computation to an expert strategy (parallel/experts.py: all-to-all over
`expert`); an attention kernel the partitioner cannot split runs per device
through a runner (parallel/context.py `per_device`). With nothing installed
all four are plain local math, so the model runs unchanged on one device.
"""

import contextlib
import contextvars
from typing import Callable

import jax

Resolver = Callable[[jax.Array, tuple], jax.Array]
Counter = Callable[[str], int]
_resolver: contextvars.ContextVar[Resolver | None] = contextvars.ContextVar("resolver", default=None)
_counter: contextvars.ContextVar[Counter | None] = contextvars.ContextVar("counter", default=None)
_placed: contextvars.ContextVar[frozenset] = contextvars.ContextVar("placed", default=frozenset())


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """Ask the installed resolver to shard `x` by its logical axis names."""
  resolve = _resolver.get()
  if resolve is None:
    return x
  placed = _placed.get()
  return resolve(x, tuple(None if name in placed else name for name in logical_axes))


def placed_outside(*logical_axes: str):
  """While tracing under this, `constrain` leaves these logical axes unsharded: for the body of a vmap
  whose mapped axis already carries them (the mapped axis itself is left to the partitioner)."""
  return _installed(_placed, _placed.get() | set(logical_axes))


def shard_count(logical_axis: str) -> int:
  """Into how many shards the installed resolver splits `logical_axis` here (1 with none installed)."""
  count = _counter.get()
  return 1 if count is None else count(logical_axis)


@contextlib.contextmanager
def activation_resolver(resolve: Resolver, count: Counter):
  """While tracing under this, `constrain` calls `resolve(x, logical_axes)` and `shard_count` calls `count`."""
  with _installed(_resolver, resolve), _installed(_counter, count):
    yield


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


LocalRunner = Callable[..., jax.Array]
_local: contextvars.ContextVar[LocalRunner | None] = contextvars.ContextVar("local", default=None)


def local_kernel(kernel: Callable, q_BTNH, k_BTKH, v_BTKH) -> jax.Array:
  """`kernel(q, k, v)` on each device's own rows and heads, through the installed runner (as is without one).

  For attention kernels the partitioner cannot split (Pallas/Mosaic: splash attention).
  """
  run = _local.get()
  return kernel(q_BTNH, k_BTKH, v_BTKH) if run is None else run(kernel, q_BTNH, k_BTKH, v_BTKH)


def local_kernels(run: LocalRunner):
  """While tracing under this, `local_kernel` calls `run(kernel, q, k, v)`."""
  return _installed(_local, run)


@contextlib.contextmanager
def _installed(variable: contextvars.ContextVar, value):
  token = variable.set(value)
  try:
    yield
  finally:
    variable.reset(token)
