"""Two processes on localhost, 4 CPU devices each, train like one process with 8 devices."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from helpers import ROOT, read_metrics, tiny_config
from parallel.distributed import free_port, wants_distributed
from run.loop import train
from training.checkpoint import Checkpoints
from training.state import abstract_inputs, plan

# Hybrid sharding over 4 processes (data=8 in groups of 4) runs in tests/test_survive.py, which also loses two.
LAYOUTS = {"data=2 x tensor=4": {"mesh.data": 2, "mesh.tensor": 4}}
RUN = {"steps": 4, "log_every": 1, "eval_every": 0, "sample_tokens": 0, "checkpoint.every": 4}


def start_two_processes(workdir, layout, second_process_flags=()):
  port = free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 "
             "--xla_backend_optimization_level=0")
  flags = [f"--config.{k}={v}" for k, v in {**RUN, **LAYOUTS[layout]}.items()]
  flags += ["--config.model.embed_dim=64", "--config.model.mlp_dim=256", "--config.model.max_len=32",
            "--config.batch_size=16", "--config.schedule.warmup_steps=2", f"--config.workdir={workdir}",
            f"--config.distributed.coordinator=localhost:{port}", "--config.distributed.num_processes=2"]
  return [subprocess.Popen([sys.executable, "train.py", *flags, f"--config.distributed.process_id={i}",
                            *(second_process_flags if i else ())],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for i in range(2)]


def two_process_run(workdir, layout):
  processes = start_two_processes(workdir, layout)
  outputs = [p.communicate(timeout=300) for p in processes]
  for process, (_, err) in zip(processes, outputs):
    assert process.returncode == 0, err[-3000:]
  return [out for out, _ in outputs]


def final_params(workdir, config):
  checkpoints = Checkpoints(str(workdir), every=4, keep=3)
  state = checkpoints.restore(4, abstract_inputs(plan(config), config)[0])
  checkpoints.close()
  return jax.device_get(state["params"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_match_one(layout, tmp_path):
  outputs = two_process_run(tmp_path / "two", layout)
  config = tiny_config(**{**RUN, **LAYOUTS[layout], "workdir": str(tmp_path / "one")})
  train(config)
  two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
  assert [r["step"] for r in two] == [1, 2, 3, 4]  # process 0 alone writes metrics
  np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
  assert "step      1" in outputs[0] and "step" not in outputs[1]  # and alone logs
  for a, b in zip(jax.tree.leaves(final_params(tmp_path / "two", config)),
                  jax.tree.leaves(final_params(tmp_path / "one", config))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_processes_started_with_different_settings_all_stop_in_one_line(tmp_path):
  # Without the check, the second process would train at its own learning rate, apart from the first.
  processes = start_two_processes(tmp_path / "run", "data=2 x tensor=4", ["--config.optimizer.lr=0.002"])
  outputs = [p.communicate(timeout=300) for p in processes]
  for process, (_, err) in zip(processes, outputs):
    assert process.returncode == 1, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "error: the processes were started with different settings: process 1 has optimizer.lr=0.002 where "
        "process 0 has 0.003; start every process with the same flags.")
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_clusters_are_detected_from_the_environment(monkeypatch):
  auto = ConfigDict({"initialize": "auto", "coordinator": "", "num_processes": 0, "process_id": -1})
  for name in ("SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(name, raising=False)
  assert not wants_distributed(auto)
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert not wants_distributed(auto)
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert wants_distributed(auto)
  monkeypatch.delenv("SLURM_NTASKS")
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w0,w1")
  assert wants_distributed(auto)
  auto.initialize = "no"
  assert not wants_distributed(auto)
