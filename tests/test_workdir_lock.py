"""The workdir lock: of runs entering together exactly one holds it, and no file in its place breaks it."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT
from resilience.workdir_lock import WorkdirLock


# Forked starters without jax (forking a process that runs XLA's threads is unsafe): each trial
# releases two of them at one barrier, and they count how many are inside the lock at once.
RACE = textwrap.dedent("""
    import json, multiprocessing as mp, sys, time
    from resilience.workdir_lock import WorkdirLock

    def enter(workdir, barrier, inside, most, held, guard):
      barrier.wait()
      try:
        with WorkdirLock(workdir):
          with guard:
            inside.value += 1
            most.value = max(most.value, inside.value)
            held.value += 1
          time.sleep(0.02)
          with guard:
            inside.value -= 1
      except ValueError:
        pass

    workdir, trials, stale = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fork = mp.get_context("fork")
    both = none = 0
    for _ in range(trials):
      if stale:
        with open(workdir + "/run.lock", "w") as f:
          f.write(stale)
      barrier, guard = fork.Barrier(2), fork.Lock()
      inside, most, held = fork.Value("i", 0), fork.Value("i", 0), fork.Value("i", 0)
      starters = [fork.Process(target=enter, args=(workdir, barrier, inside, most, held, guard)) for _ in range(2)]
      for p in starters:
        p.start()
      for p in starters:
        p.join()
      both += most.value > 1
      none += held.value == 0
    print(json.dumps({"both": both, "none": none}))
    """)


def race(workdir, trials: int, stale: str = "") -> dict:
  result = subprocess.run([sys.executable, "-c", RACE, str(workdir), str(trials), stale], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=True)
  return json.loads(result.stdout)


def dead_pid() -> int:
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  return gone.pid


def test_of_two_starters_entering_together_exactly_one_holds_the_lock(tmp_path):
  assert race(tmp_path, trials=150) == {"both": 0, "none": 0}


def test_of_two_starters_finding_a_stale_lock_exactly_one_takes_it_over(tmp_path):
  stale = json.dumps({"host": socket.gethostname(), "pid": dead_pid()})
  assert race(tmp_path, trials=150, stale=stale) == {"both": 0, "none": 0}


HOLD = "import sys, time; from resilience.workdir_lock import WorkdirLock\n" \
       "with WorkdirLock(sys.argv[1]):\n  print('held', flush=True); time.sleep(600)"


@pytest.fixture
def holder(tmp_path):
  """A process holding tmp_path's lock until the test kills it."""
  process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  assert process.stdout.readline() == "held\n"
  yield process
  process.kill()
  process.wait()


def test_a_held_lock_is_refused_naming_its_holder(tmp_path, holder):
  with pytest.raises(ValueError, match=rf"^{tmp_path} is in use by the run of pid {holder.pid} on "
                                       rf"{socket.gethostname()} \({tmp_path / 'run.lock'}\); wait for it to end"):
    WorkdirLock(str(tmp_path)).__enter__()


def test_a_held_lock_that_names_no_holder_yet_is_refused_not_taken_over(tmp_path, holder):
  (tmp_path / "run.lock").write_text("")  # the holder is still writing its name
  with pytest.raises(ValueError, match=r"in use by another run \(still starting: its lock names no holder yet\)"):
    WorkdirLock(str(tmp_path)).__enter__()


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, holder):
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  assert json.loads((tmp_path / "run.lock").read_text())["pid"] == holder.pid  # left behind by the kill
  with WorkdirLock(str(tmp_path)):
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
  assert not (tmp_path / "run.lock").exists()


@pytest.mark.parametrize("content", ["[1, 2]", "not json", "\xff"])
def test_a_lock_file_no_run_holds_is_taken_over_whatever_it_holds(tmp_path, content):
  (tmp_path / "run.lock").write_text(content, encoding="latin-1")
  with WorkdirLock(str(tmp_path)):
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()


def test_a_lock_from_another_host_is_refused_for_a_person_to_judge(tmp_path):
  (tmp_path / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
  with pytest.raises(ValueError, match=r"in use by the run of pid 1 on elsewhere .*\(delete the lock only if that run is gone"):
    WorkdirLock(str(tmp_path)).__enter__()
  assert json.loads((tmp_path / "run.lock").read_text()) == {"host": "elsewhere", "pid": 1}


def test_a_folder_in_the_locks_place_is_refused_in_one_line(tmp_path):
  (tmp_path / "run.lock").mkdir()
  with pytest.raises(ValueError, match=rf"^{tmp_path / 'run.lock'} is a folder, not a run's lock file; remove it "):
    WorkdirLock(str(tmp_path)).__enter__()
  assert (tmp_path / "run.lock").is_dir()


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_link_in_the_locks_place_is_refused_and_its_target_left_alone(tmp_path, target_exists):
  target = tmp_path / "notes.txt"
  if target_exists:
    target.write_text("someone's notes")
  (tmp_path / "run.lock").symlink_to(target)
  with pytest.raises(ValueError, match=rf"^{tmp_path / 'run.lock'} is a symbolic link to {target}, not a run's "
                                       "lock file; remove the link or choose another --config.workdir.$"):
    WorkdirLock(str(tmp_path)).__enter__()
  assert (tmp_path / "run.lock").is_symlink()
  assert target.read_text() == "someone's notes" if target_exists else not target.exists()
