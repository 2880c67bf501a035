"""The planner against what ran: every committed bench record (benchmarks/) predicted as it ran and held to
a stated band of its measured step, `tools/plan.py --check` printing them, and its refusals of bad files.
Arithmetic only: nothing is compiled."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT
from measure import planning_tables

RECORDS = sorted(str(p) for p in ROOT.glob("benchmarks/*/*.jsonl"))

# The goal is 15% of the measured step. Today's model misses it on every committed H200 row, all
# optimistic: GPT-2 124M at -42% to -43%, 1.5B at -31% to -33% (docs/planning.md prints each row). This is
# the band that holds today, so that a change to the model that moves a row further away fails here.
BAND = 0.45


@pytest.fixture(scope="module")
def checked():
  return planning_tables.check_records(RECORDS)


def test_every_measured_record_is_predicted_within_the_band(checked):
  assert len(checked) == sum(1 for path in RECORDS for line in open(path)
                             if json.loads(line).get("kind") == "meshlm" and json.loads(line).get("step_s"))
  for c in checked:
    assert abs(c.error) <= BAND, (c.label, c.predicted.step, c.measured_step)
    assert c.kind == "h200"


def test_the_check_prints_one_row_per_record_with_its_error():
  result = subprocess.run([sys.executable, "tools/plan.py", f"--check={RECORDS[0]}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  rows = [line for line in result.stdout.splitlines() if line.startswith("| configs/")]
  assert len(rows) == len(planning_tables.measured_records([RECORDS[0]]))
  assert all("h200" in row and "%" in row for row in rows)


def test_a_missing_file_is_refused(tmp_path):
  with pytest.raises(ValueError, match=r"^--check=\S+nothing.jsonl is not a file; give tools/bench.py's JSON lines"):
    planning_tables.measured_records([str(tmp_path / "nothing.jsonl")])


def test_a_file_without_a_measured_step_is_refused(tmp_path):
  path = tmp_path / "peers.jsonl"
  path.write_text(json.dumps({"kind": "peer", "peer": "torch.compile", "step_s": 0.064}) + "\n")
  with pytest.raises(ValueError, match=r"holds no measured meshlm step"):
    planning_tables.measured_records([str(path)])


def test_a_device_no_kind_describes_is_refused():
  with pytest.raises(ValueError, match=r"^r.jsonl: device_kind 'cpu' names no one kind of measure/hardware.py"):
    planning_tables.kind_of("cpu", "r.jsonl")
