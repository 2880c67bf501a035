"""Rejoin (fault_tolerance=survive): the mesh grows back, and devices that hold no state get a live replica's.

When the live devices outnumber the mesh (a restarted process is back), the run is laid out again
from its own config over all of them, and the live processes send the state over the grown mesh
(resilience/state_transfer.py: the newcomers put in zeros); nothing is read from disk.

A restarted process learns that it is rejoining from the coordination service, which process 0
hosts and which outlives every other process: process 0 marks the run as started once all the
processes that started it together have looked for the mark, so only a later start finds it.
"""

import jax

from parallel import jax_compat

_STARTED = "meshlm/run_started"  # the coordination service's key: set, the run is in progress
_START_TIMEOUT_MS = 10 * 60 * 1000  # the processes of one start may be launched minutes apart


def joining_run() -> bool:
  """Whether this process is restarting into a run in progress (fault_tolerance=survive, several processes).

  Every process that starts the run together waits at one barrier after looking for the mark, and
  only then does process 0 set it: none of them can see it, and a process started again later does.
  """
  client = jax_compat.coordination_client()
  try:
    client.key_value_try_get(_STARTED)
    return True
  except jax.errors.JaxRuntimeError as missing:
    if "NOT_FOUND" not in str(missing):
      raise
  client.wait_at_barrier("meshlm/looked_for_run", _START_TIMEOUT_MS)
  if jax.process_index() == 0:
    client.key_value_set(_STARTED, "1")
  return False


def refuse_on_cpu() -> None:
  """Ends a joining process on the CPU, where gloo cannot take it back, before the live ones wait for it.

  The restarted process's first collective fails (ALREADY_EXISTS: its first life's gloo rendezvous
  keys are still in the coordination service), and its failure takes the live processes down with
  it; leaving at once keeps their run going.
  """
  if jax.default_backend() != "cpu":
    return
  jax.distributed.shutdown()  # out of the live processes' next barrier now, not a heartbeat later
  raise ValueError(f"process {jax.process_index()} was started again into a run in progress, but rejoining "
                   "needs GPUs: on the CPU, gloo refuses a restarted process's collectives, so the run "
                   "carries on without it.")
