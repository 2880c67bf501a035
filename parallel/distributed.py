"""Multi-host start-up through jax.distributed, before anything touches a device."""

import json
import os
import socket

import jax

from parallel import jax_compat

# Variables that mean "this process is one of several": TPU pod workers and SLURM tasks.
_CLUSTER_VARIABLES = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_NTASKS")


def wants_distributed(dist_config) -> bool:
  """Whether to call jax.distributed.initialize, from the config or the environment."""
  if dist_config.initialize not in ("auto", "yes", "no"):
    raise ValueError(f"distributed.initialize={dist_config.initialize!r} is unknown; use auto, yes or no.")
  if dist_config.initialize != "auto":
    return dist_config.initialize == "yes"
  if dist_config.coordinator:
    return True
  if os.environ.get("SLURM_NTASKS", "1") != "1":
    return True
  return any(os.environ.get(name) for name in _CLUSTER_VARIABLES if name != "SLURM_NTASKS")


def initialize(dist_config, survive: bool = False) -> None:
  """Join the other processes; explicit flags win, otherwise jax detects TPU pods and SLURM.

  `survive` turns off fate sharing (a lost process no longer ends the others) and lets a
  collective waiting on a dead peer fail instead of hanging, so a step can be redone without it.
  Process 0 hosts the coordination service: the run survives any process but that one.
  """
  if not wants_distributed(dist_config):
    return
  explicit = {"heartbeat_timeout_seconds": dist_config.heartbeat_seconds}
  if survive:
    _abandon_collectives_after(COLLECTIVE_PATIENCE * dist_config.heartbeat_seconds)
    jax.config.update("jax_enable_recoverability", True)
  if dist_config.coordinator:
    explicit["coordinator_address"] = dist_config.coordinator
  if dist_config.num_processes > 0:
    explicit["num_processes"] = dist_config.num_processes
  if dist_config.process_id >= 0:
    explicit["process_id"] = dist_config.process_id
  jax.distributed.initialize(**explicit)


# How many heartbeats a CPU (gloo) collective waits for a peer. Whether a process is lost is the
# coordination service's call, after one heartbeat; a killed peer's sockets close and its collectives
# fail at once. A collective that gives up on a live peer that is merely late (descheduled on a busy
# host, still compiling) fails the run instead, with no process lost to recover from, so it waits
# longer than the service: a process hung in place is then found after three heartbeats, not one.
COLLECTIVE_PATIENCE = 3


def _abandon_collectives_after(seconds: int) -> None:
  """XLA settings, read when the backend starts, under which a collective with a dead peer fails.

  CPU (gloo) waits `seconds` and raises; GPU (NCCL) is aborted on the failure, as JAX's fault
  tolerance guide sets it up. Without them the survivors of a lost process wait on it forever.
  """
  flags = [f"--xla_cpu_collective_timeout_seconds={seconds}", "--xla_gpu_nccl_terminate_on_error=false",
           "--xla_gpu_nccl_async_execution=true", "--xla_gpu_nccl_blocking_communicators=false"]
  present = os.environ.get("XLA_FLAGS", "").split()
  names = {flag.split("=")[0] for flag in present}
  os.environ["XLA_FLAGS"] = " ".join(present + [f for f in flags if f.split("=")[0] not in names])
  os.environ.setdefault("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "1")
  os.environ.setdefault("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "1")  # the GPU client that can abort


_CONFIG_KEY = "meshlm/config"  # in the coordination service's key-value store


def check_same_config(config) -> None:
  """Refuse, on every process, a run whose processes were started with different settings.

  A process with another learning rate would train apart from the others without a word, and one
  with another batch or mesh would hang in the first collective. Process 0 publishes its settings
  through the coordination service, every other process compares its own and answers, and process
  0 waits for each answer, so every process stops with the same sentence. `distributed.*` may differ
  (each process's id). A process rejoining a surviving run compares and answers the same way.
  """
  if jax.process_count() == 1:
    return
  client = jax_compat.coordination_client()
  timeout_ms = config.distributed.heartbeat_seconds * 1000
  mine = json.loads(json.dumps(_settings(config)))  # as process 0's arrives: tuples as lists
  if jax.process_index() == 0:
    client.key_value_set(_CONFIG_KEY, json.dumps(mine), allow_overwrite=True)
    answers = [client.blocking_key_value_get(f"{_CONFIG_KEY}/{process}", timeout_ms)
               for process in range(1, jax.process_count())]
    mismatch = next((answer for answer in answers if answer != "same"), None)
  else:
    first = json.loads(client.blocking_key_value_get(_CONFIG_KEY, timeout_ms))
    field = next((f for f in sorted(first.keys() | mine.keys()) if first.get(f) != mine.get(f)), None)
    mismatch = field and (f"process {jax.process_index()} has {field}={mine.get(field)!r} where process 0 has "
                          f"{first.get(field)!r}")
    client.key_value_set(f"{_CONFIG_KEY}/{jax.process_index()}", mismatch or "same", allow_overwrite=True)
  if mismatch:
    raise ValueError(f"the processes were started with different settings: {mismatch}; start every process "
                     "with the same flags.")


def _settings(config) -> dict:
  """The config as dotted field -> value, without `distributed` (which differs between processes)."""
  def flat(node, prefix):
    for key, value in node.items():
      if isinstance(value, dict):
        yield from flat(value, f"{prefix}{key}.")
      else:
        yield f"{prefix}{key}", value
  return {field: value for field, value in flat(config.to_dict(), "") if not field.startswith("distributed.")}


def free_port() -> int:
  """A loopback port no one listens on now: for the coordinator of processes started on this machine."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]
