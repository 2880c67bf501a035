"""Multi-host start-up through jax.distributed, before anything touches a device."""

import os

import jax

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


def initialize(dist_config) -> None:
  """Join the other processes; explicit flags win, otherwise jax detects TPU pods and SLURM."""
  if not wants_distributed(dist_config):
    return
  explicit = {}
  if dist_config.coordinator:
    explicit["coordinator_address"] = dist_config.coordinator
  if dist_config.num_processes > 0:
    explicit["num_processes"] = dist_config.num_processes
  if dist_config.process_id >= 0:
    explicit["process_id"] = dist_config.process_id
  jax.distributed.initialize(**explicit)
