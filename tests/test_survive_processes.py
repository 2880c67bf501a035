"""fault_tolerance=survive for real: runs of 4 processes that lose some mid-run, against the same run
uninterrupted (hybrid sharding losing two; ZeRO-3 from peer copies). In a file of their own so that the
test workers share the suite's slowest runs. A pipeline x tensor replica spanning processes is rebuilt
in one process standing for four (tests/test_survive.py, tests/test_peer_copies.py); its 4-process run
(about 100 s) was dropped to keep the suite's time."""

import subprocess
import sys

import jax
import numpy as np

from helpers import ROOT, read_metrics, tiny_config, what_went_wrong
from measure import goodput
from run.loop import train
from training.checkpoint import Checkpoints
from training.state import abstract_inputs, plan


RUN = {"steps": 6, "log_every": 1, "eval_every": 3, "eval_batches": 1, "sample_tokens": 0, "checkpoint.every": 3,
       "batch_size": 24, "mesh.data": 8}


def launch(workdir, *launch_flags, **overrides):
  flags = [f"--config.{k}={v}" for k, v in {**RUN, **overrides}.items()]
  flags += ["--config.model.embed_dim=64", "--config.model.mlp_dim=256", "--config.model.max_len=32",
            "--config.schedule.warmup_steps=2", "--config.distributed.heartbeat_seconds=10",
            f"--config.workdir={workdir}"]
  try:
    result = subprocess.run([sys.executable, "tools/launch.py", *launch_flags, "--", "train.py", *flags],
                            cwd=ROOT, capture_output=True, text=True, timeout=250)
  except subprocess.TimeoutExpired as stuck:  # say where the processes were, not only that they were slow
    said = lambda stream: stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""
    raise AssertionError("the run took over 250 s; it printed:\n"
                         + what_went_wrong(said(stuck.stdout) + said(stuck.stderr))) from None
  assert result.returncode == 0, what_went_wrong(result.stdout + result.stderr)
  return result.stdout + result.stderr


def final_params(workdir, config):
  checkpoints = Checkpoints(str(workdir), every=3, keep=3)
  state = checkpoints.restore(config.steps, abstract_inputs(plan(config), config)[0])
  checkpoints.close()
  return jax.device_get(state["params"])


def test_four_processes_lose_two_and_train_on_as_if_nothing_happened(tmp_path):
  # Hybrid sharding, 2 replicas of 4-way ZeRO-3, which takes both ways of rebuilding the state: after
  # the first loss the groups shrink to 2 devices and each shard is sent from a live copy across
  # processes; after the second each process holds a whole copy and moves it onto its own devices,
  # as plain data parallelism always does. Process 2 dies wherever step 2's log line finds it; process 3
  # is stopped after step 4 and killed 3 s later, while the others wait for it inside step 5's collectives.
  output = launch(tmp_path / "survived", "--processes=4", "--kill=2@step=2", "--kill=3@step=4:stall=3",
                  fault_tolerance="survive", **{"sharding.zero": 3, "sharding.fsdp_group": 4})
  config = tiny_config(**{**RUN, "workdir": str(tmp_path / "whole")})
  train(config)
  survived, whole = read_metrics(tmp_path / "survived"), read_metrics(tmp_path / "whole")
  failures = [r for r in survived if "recovery_seconds" in r]
  assert [(r["steps_lost"], r["live_devices"]) for r in failures] == [(0, 6), (0, 4)]
  assert output.count(": 0 steps lost") == 2 and "resuming" not in output  # no checkpoint was read
  losses = [r["loss"] for r in survived if "loss" in r]
  # Against plain data parallelism, float32 noise from the reduction order: 8 devices in groups of 4,
  # then 6 in groups of 2 with 2 micro-batches, then 4 with 6.
  np.testing.assert_allclose(losses, [r["loss"] for r in whole if "loss" in r], rtol=1e-5)
  # Evaluation runs inside the protected block too, on whichever mesh is live at the time.
  evals = lambda rs: [(r["step"], r["eval_loss"]) for r in rs if "eval_loss" in r]
  assert [s for s, _ in evals(survived)] == [3, 6]
  np.testing.assert_allclose([l for _, l in evals(survived)], [l for _, l in evals(whole)], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(final_params(tmp_path / "survived", config)),
                  jax.tree.leaves(final_params(tmp_path / "whole", config))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def per_step(records, key):
  """{step: its record's `key`}, where each step has one: a run that rolled back to a peer copy drops
  the records of the steps it redoes before it writes them again."""
  steps = [r["step"] for r in records if key in r]
  assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
  return {r["step"]: r[key] for r in records if key in r}


def survived_beside_whole(tmp_path, kill: str, **overrides):
  """A surviving 4-process run with peer copies every 2 steps and `kill`, and the same run on one
  process uninterrupted: (the launcher's output, the records of each, the uninterrupted config)."""
  output = launch(tmp_path / "survived", "--processes=4", kill, fault_tolerance="survive", peer_copy_every=2,
                  **overrides)
  config = tiny_config(**{**RUN, **overrides, "workdir": str(tmp_path / "whole")})
  train(config)
  survived, whole = read_metrics(tmp_path / "survived"), read_metrics(tmp_path / "whole")
  survived_losses, whole_losses = per_step(survived, "loss"), per_step(whole, "loss")
  assert sorted(survived_losses) == list(range(1, config.steps + 1))
  assert all(speed > 0 for speed in per_step(survived, "tokens_per_sec").values())
  # float32 noise from the reduction order on the survivors' smaller mesh and micro-batches.
  np.testing.assert_allclose([survived_losses[s] for s in sorted(survived_losses)],
                             [whole_losses[s] for s in sorted(survived_losses)], rtol=1e-5)
  return output, survived, whole, config


def test_zero3_over_processes_survives_a_kill_during_a_save_from_peer_copies(tmp_path):
  # ZeRO-3 over data=8 on 4 processes holds each shard on one process only; peer copies every 2 steps
  # keep each process's shards in the next one's host memory. Process 2 is stopped after step 3's log
  # line and killed 3 s later, while the others wait for it inside step 3's save: the save is abandoned,
  # and the survivors roll back to the copy of step 2, then redo steps 3 and 4 on 4 of the 6 live
  # devices (16 rows do not divide over 6 replicas; 4 take 2 micro-batches of 2 rows each).
  output, survived, _, config = survived_beside_whole(tmp_path, "--kill=2@step=3:stall=3", batch_size=16, steps=4,
                                                      **{"sharding.zero": 3, "checkpoint.every": 1})
  failures = [r for r in survived if "recovery_seconds" in r]
  assert [(r["failed_step"], r["steps_lost"], r["live_devices"]) for r in failures] == [(4, 1, 4)]
  assert "the save was abandoned" in output and "resuming" not in output  # no checkpoint was read
  assert "launch: killed after step 3: 1 steps lost" in output
  copies = [r for r in survived if "peer_copy_bytes_sent" in r]
  assert copies and copies[0]["peer_copy_host_bytes"] < copies[0]["peer_copy_bytes_sent"]  # a share, not all
  for a, b in zip(jax.tree.leaves(final_params(tmp_path / "survived", config)),
                  jax.tree.leaves(final_params(tmp_path / "whole", config))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  ledger = goodput.run_ledger(tmp_path / "survived")
  assert ledger["recomputed"] > 0 and ledger["failure_detect"] > 0 and ledger["restart"] == 0


def test_two_processes_shrunk_to_one_go_on_saving(tmp_path):
  # Process 1 dies after step 3; process 0 trains on alone, its state on its own 2 devices while the
  # run still counts 2 processes (orbax took such arrays for host-local ones and refused to save step 4).
  # No save comes before the kill: one still in flight as process 1 dies keeps process 0 from exiting
  # until orbax's 20-minute barrier times out (the fresh-clone suite of 2026-12-06 met it once).
  overrides = {"batch_size": 8, "checkpoint.every": 4}
  output = launch(tmp_path / "survived", "--processes=2", "--kill=1@step=3", fault_tolerance="survive",
                  **overrides, **{"mesh.data": 4})
  assert "redid the step on 2 devices" in output and "error" not in output
  assert sorted(int(p.name) for p in (tmp_path / "survived" / "checkpoints").iterdir()) == [4, 6]
  config = tiny_config(**{**RUN, **overrides, "workdir": str(tmp_path / "whole")})
  train(config)
  np.testing.assert_allclose(list(per_step(read_metrics(tmp_path / "survived"), "loss").values()),
                             list(per_step(read_metrics(tmp_path / "whole"), "loss").values()), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(final_params(tmp_path / "survived", config)),
                  jax.tree.leaves(final_params(tmp_path / "whole", config))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
