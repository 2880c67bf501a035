"""A multi-process job that loses a process says so in one line: the launcher names the process that
ended it, and a save that a lost process broke is not called a full disk."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT, logged_steps, wait_for, what_went_wrong

RUN = {"log_every": 1, "eval_every": 0, "sample_tokens": 0, "batch_size": 24, "mesh.data": 8,
       "model.embed_dim": 64, "model.mlp_dim": 256, "model.max_len": 32, "schedule.warmup_steps": 2,
       "distributed.heartbeat_seconds": 10}


def launch_command(workdir, *launch_flags, **overrides) -> list[str]:
  """tools/launch.py with 2 processes of 4 devices."""
  flags = [f"--config.{k}={v}" for k, v in {**RUN, **overrides, "workdir": workdir}.items()]
  return [sys.executable, "tools/launch.py", "--processes=2", "--devices=4", *launch_flags, "--", "train.py", *flags]


def launched(launcher, process: int) -> int:
  """The pid of the launcher's process `process`."""
  for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
    if f"--config.distributed.process_id={process}" in Path(f"/proc/{pid}/cmdline").read_text().split("\0"):
      return int(pid)
  raise AssertionError(f"the launcher runs no process {process}")


def test_a_killed_process_0_ends_the_job_and_the_launcher_names_it(tmp_path):
  launcher = subprocess.Popen(launch_command(tmp_path, steps=400, **{"checkpoint.every": 100}), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    wait_for(lambda: launcher.poll() is not None or max(logged_steps(tmp_path), default=0) >= 2, timeout=200)
    assert launcher.poll() is None, what_went_wrong(launcher.communicate()[0])
    killed_at = time.perf_counter()
    os.kill(launched(launcher, 0), signal.SIGKILL)
    output, _ = launcher.communicate(timeout=60)
  finally:
    launcher.kill()
  assert time.perf_counter() - killed_at < 5  # every process ends with process 0
  assert launcher.returncode == 128 + signal.SIGKILL, what_went_wrong(output)
  # After the progress bar process 0 was drawing when it died, on the same line.
  assert [line[line.index("launch:"):] for line in output.splitlines() if "launch:" in line] == [
      "launch: process 0 ended first (killed by SIGKILL); process 0 hosts the coordination service, so every "
      "process ended with it: no checkpoint was saved, so the same command starts over from step 0."]
  assert "Traceback" not in output


def test_a_process_lost_during_a_save_is_named_as_the_cause_not_a_full_disk(tmp_path):
  # Process 1 is killed once step 3 is logged, inside the run's first save (seconds, where a step
  # takes a fraction of one): process 0's part of it fails in the collective with the dead process.
  # ZeRO-3 over both processes, with no peer copies, cannot survive it (a surviving run abandons the
  # save and goes on: test_survive.py).
  result = subprocess.run(launch_command(tmp_path, "--kill=1@step=3", steps=6, fault_tolerance="survive",
                                          **{"checkpoint.every": 3, "sharding.zero": 3}),
                          cwd=ROOT, capture_output=True, text=True, timeout=250)
  output = result.stdout + result.stderr
  assert result.returncode == 1, what_went_wrong(output)
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and re.fullmatch(
      rf"error: saving a checkpoint into {tmp_path}/checkpoints failed \(JaxRuntimeError: .*\); another process of "
      r"the run was lost during the save \(\d+ MiB are free: not a full disk\)\. The newest saved checkpoint is "
      r"none: run the same command to start over from step 0\.", errors[0]), what_went_wrong(output)
  assert "launch: process 1 ended first (killed by SIGKILL from --kill), and the job with it: no checkpoint was " \
      "saved, so the same command starts over from step 0." in output
  assert "Traceback" not in output
  assert not (tmp_path / "checkpoints" / "3").exists()


def test_without_survive_mode_the_launcher_explains_the_fate_sharing_abort_last(tmp_path):
  # JAX's fate sharing aborts process 0 after process 1's loss, printing a C++ stack on this console
  # (why the survivors cannot end in a line of their own: tools/launch.py's first_to_fail). The
  # launcher's line comes after it, naming the lost process, the abort and the checkpoint to resume from.
  result = subprocess.run(launch_command(tmp_path, "--kill=1@step=3", steps=400, **{"checkpoint.every": 2}),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=250)
  assert result.returncode == 128 + signal.SIGABRT, what_went_wrong(result.stdout)
  last = result.stdout.splitlines()[-1]
  assert re.fullmatch(r"launch: process 1 ended first \(killed by SIGKILL from --kill\), and the job with it "
                      r"\(JAX's fate sharing aborted process 0: the C\+\+ stack above is that abort, not a second "
                      r"fault\): (run the same command to resume from checkpoint step \d+|no checkpoint was saved, "
                      r"so the same command starts over from step 0)\.", last), last
