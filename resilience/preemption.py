"""SIGTERM and SIGINT end a run cleanly: finish the step, save, exit 0."""

import signal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
  """Records a stop signal; the loop asks after every step whether to stop there."""

  def __init__(self):
    self.signal_name = None
    self._previous = {}

  def __enter__(self):
    for sig in _SIGNALS:
      self._previous[sig] = signal.signal(sig, self._record)
    return self

  def __exit__(self, *exc_info):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _record(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name

  def requested(self, step: int, every: int, devices=None) -> bool:
    """Whether to stop after `step`.

    One process decides alone. Several must stop at the same step or the
    checkpoint's collectives would hang, so they agree on it every `every`
    steps (a host all-gather each time: cheap beside `every` train steps).
    """
    if jax.process_count() == 1:
      return self.signal_name is not None
    if step % every:
      return False
    votes = _allgather(np.int32(self.signal_name is not None), devices)
    if votes.any() and self.signal_name is None:
      self.signal_name = "a signal to another process"
    return bool(votes.any())


def _allgather(flag: np.int32, devices) -> np.ndarray:
  """`flag` from every process with a device in `devices` (all processes when None)."""
  if devices is None:
    return multihost_utils.process_allgather(flag)
  devices = list(devices)  # after a lost process (fault_tolerance=survive), only the live ones
  sharding = NamedSharding(Mesh(np.array(devices), ("devices",)), P("devices"))
  spread = jax.make_array_from_callback((len(devices),), sharding, lambda index: np.full((1,), flag))
  gathered = jax.jit(_identity, out_shardings=NamedSharding(sharding.mesh, P()))(spread)
  return np.asarray(gathered.addressable_shards[0].data)


def _identity(x):
  return x  # one function, so each mesh's all-gather compiles once
