"""The goodput ledger: each attempt's wall time by cause, and a restarted run's attempts added up
with the time the job was down between them."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT
from measure import goodput
from measure.goodput import CAUSES, Ledger
from tools import goodput as goodput_tool


def test_a_step_is_productive_the_first_time_and_recomputed_after_a_rollback(monkeypatch):
  clock = iter([0.0, 2.0, 3.0, 7.0, 8.0, 10.0, 11.0])  # perf_counter at each call below
  monkeypatch.setattr(goodput.time, "perf_counter", lambda: next(clock))
  ledger = Ledger(done_before=0)  # 0.0
  ledger.step(1)  # 2.0: 2 s for step 1
  with ledger.timing("checkpoint_save"):  # 3.0 .. 7.0
    pass
  ledger.step(2)  # 8.0: the 2 s since step 1 that the save did not take
  ledger.step(2)  # 10.0: rolled back, step 2 again
  record = ledger.record()  # 11.0: 1 s that no cause took
  assert (record["productive"], record["checkpoint_save"], record["recomputed"], record["other"]) == (4, 4, 2, 1)
  assert record["wall"] == 11 and sum(record[cause] for cause in CAUSES) == 11


def write_attempt(path, started_at, wall, **seconds):
  record = {"step": 1, **{c: seconds.get(c, 0.0) for c in CAUSES}, "started_at": started_at, "wall": wall}
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def test_a_restarted_runs_attempts_add_up_with_the_time_it_was_down(tmp_path):
  path = tmp_path / "goodput.jsonl"
  write_attempt(path, 100.0, 5.0, productive=1.0, compile=4.0)  # an earlier word of the first attempt
  write_attempt(path, 100.0, 10.0, productive=6.0, compile=4.0)  # its last: killed at 110
  write_attempt(path, 130.0, 20.0, productive=10.0, compile=4.0, recomputed=6.0)  # up again 20 s later
  ledger = goodput.run_ledger(tmp_path)
  assert (ledger["attempts"], ledger["productive"], ledger["compile"], ledger["recomputed"], ledger["restart"],
          ledger["wall"]) == (2, 16.0, 8.0, 6.0, 20.0, 50.0)
  table = subprocess.run([sys.executable, "tools/goodput.py", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
  assert "| **goodput** | **32.0%** |" in table and "| restart: the job down" in table


def test_a_run_without_a_ledger_is_refused_in_a_sentence(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
  with pytest.raises(ValueError, match=r"^.*goodput.jsonl does not exist; give the --config.workdir of a run that"):
    goodput.run_ledger(tmp_path)


@pytest.mark.parametrize("text, says", [
    ("", "holds no ledger record with time in it"),
    ("not a ledger\n", "holds no ledger record with time in it"),
    ("garbage}\n", "is not a goodput ledger (JSONDecodeError: Expecting value"),
    ('{"step": 1}\n', "is not a goodput ledger (KeyError: 'started_at')"),
    ('{"started_at": 1.0, "wall": 0.0}\n', "is not a goodput ledger (KeyError: 'productive')"),
])
def test_an_empty_or_garbled_ledger_is_refused_in_one_line(tmp_path, capsys, text, says):
  (tmp_path / "goodput.jsonl").write_text(text)
  assert goodput_tool.main([str(tmp_path)]) == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / 'goodput.jsonl'} {says}"), lines
