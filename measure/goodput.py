"""Where a run's wall time went (its goodput ledger), as MaxText's goodput package reports it: the
productive steps against each cause of badput.

Each start of a run (an attempt) keeps a `Ledger` and appends it to <workdir>/goodput.jsonl at
every log step and at the end, in seconds by cause; no attempt removes another's (a resumed run
drops the metrics.jsonl records of the steps it does again, not the time they took). So
`run_table` reads a whole run, however often it was restarted: each attempt's last ledger, and the
time between one attempt's last word and the next one's start (the job down: detection and restart).
"""

import contextlib
import json
import time
from pathlib import Path

LEDGER_FILE = "goodput.jsonl"  # in the workdir, beside metrics.jsonl

# The causes, in the order a table lists them; `productive` is the goodput.
CAUSES = {
    "productive": "steps done for the first time",
    "startup": "starting up: processes, data, layout, initial state",
    "compile": "compiling the steps before the first",
    "checkpoint_restore": "reading the checkpoint resumed from",
    "data_wait": "waiting for batches",
    "generation": "sampling the rollouts a step trains on (objective=grpo)",
    "evaluation": "evaluating",
    "checkpoint_save": "saving checkpoints (the blocking part)",
    "failure_detect": "a lost process: until every live process knew",
    "failure_recompile": "a lost process: laying out and compiling for the live devices",
    "failure_relayout": "a lost process: moving or rebuilding the state",
    "recomputed": "steps done again (rolled back to a copy or a checkpoint)",
    "restart": "the job down between attempts: detection and restart",
    "other": "the rest: logging, the closing sample",
}


class Ledger:
  """One attempt's wall time by cause; `productive` and `recomputed` are split by whether the step
  was done before (by this attempt, or by an earlier one up to `done_before`)."""

  def __init__(self, done_before: int = 0):
    self.started_at = time.time()  # to line attempts up in a run's metrics.jsonl
    self._began = time.perf_counter()
    self._seconds = dict.fromkeys(CAUSES, 0.0)
    self._highest = done_before

  def add(self, cause: str, seconds: float) -> None:
    self._seconds[cause] += seconds

  @contextlib.contextmanager
  def timing(self, cause: str):
    began = time.perf_counter()
    try:
      yield
    finally:
      self.add(cause, time.perf_counter() - began)

  def step(self, step: int) -> None:
    """Step `step` done: the time no cause has taken since the last is its own, productive the first
    time and recomputed after a rollback (or a restart)."""
    self.add("recomputed" if step <= self._highest else "productive", self.unaccounted())
    self._highest = max(self._highest, step)

  def lost_process(self, record: dict) -> None:
    """A lost process's costs, from its event's metrics record (resilience/survive_events.py)."""
    for cause, key in (("failure_detect", "detect_seconds"), ("failure_recompile", "recompile_seconds"),
                       ("failure_relayout", "relayout_seconds")):
      self.add(cause, record.get(key, 0.0))

  def unaccounted(self) -> float:
    return time.perf_counter() - self._began - sum(self._seconds.values())

  def record(self) -> dict:
    """The ledger so far, as goodput.jsonl holds it; time not given a cause is `other`."""
    wall = time.perf_counter() - self._began
    seconds = {**self._seconds, "other": self._seconds["other"] + max(0.0, wall - sum(self._seconds.values()))}
    return {"started_at": self.started_at, "wall": wall, **seconds}

  def write(self, workdir, step: int) -> dict:
    """Appends the ledger after step `step` to the workdir's goodput.jsonl; returns what it wrote."""
    record = {"step": step, **self.record()}
    with open(Path(workdir) / LEDGER_FILE, "a") as f:
      f.write(json.dumps(record) + "\n")
    return record


def steps_logged(workdir) -> int:
  """The highest step metrics.jsonl has a loss for: what an attempt after a restart does again."""
  path = Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return 0
  steps = [record.get("step", 0) for record in records(path) if "loss" in record]
  return max(steps, default=0)


def run_ledger(run_dir) -> dict:
  """A run's wall time by cause over all its attempts, with `wall` and `attempts`."""
  path = Path(run_dir) / LEDGER_FILE
  advice = "give the --config.workdir of a run that has logged a step with this version of meshlm."
  if not path.exists():
    raise ValueError(f"{path} does not exist; {advice}")
  attempts: dict[float, dict] = {}
  try:
    for record in records(path):
      attempts[record["started_at"]] = record  # the last word of each attempt
    ordered = [attempts[start] for start in sorted(attempts)]
    total = {cause: sum(a[cause] for a in ordered) for cause in CAUSES}
    total["restart"] += sum(max(0.0, after["started_at"] - (before["started_at"] + before["wall"]))
                            for before, after in zip(ordered, ordered[1:]))
  except (ValueError, KeyError, TypeError) as error:  # not JSON, or records without a ledger's fields
    raise ValueError(f"{path} is not a goodput ledger ({type(error).__name__}: {error}); {advice}") from None
  total["wall"] = sum(total[cause] for cause in CAUSES)
  if not total["wall"]:  # no record (or none with time in it): its table would be shares of nothing
    raise ValueError(f"{path} holds no ledger record with time in it; {advice}")
  total["attempts"] = len(ordered)
  return total


def run_table(run_dirs: list) -> str:
  """A markdown table of where each run's wall time went, the runs side by side."""
  return table({Path(run_dir).name: run_ledger(run_dir) for run_dir in run_dirs})


def attempt_totals(record: dict) -> dict:
  """One attempt's ledger record as `table` takes it."""
  return {**record, "attempts": 1}


def table(named: dict) -> str:
  """A markdown table of where each run's wall time went (`named`: run -> its totals), side by side."""
  ledgers = list(named.values())
  lines = ["| cause | " + " | ".join(named) + " |", "|---|" + "---:|" * len(named)]
  for cause, meaning in CAUSES.items():
    if any(ledger[cause] for ledger in ledgers):
      cells = [f"{ledger[cause]:.1f} s ({ledger[cause] / ledger['wall']:.1%})" for ledger in ledgers]
      lines.append(f"| {cause}: {meaning} | " + " | ".join(cells) + " |")
  lines.append("| wall (attempts) | " + " | ".join(f"{l['wall']:.1f} s ({l['attempts']})" for l in ledgers) + " |")
  lines.append("| **goodput** | " + " | ".join(f"**{l['productive'] / l['wall']:.1%}**" for l in ledgers) + " |")
  return "\n".join(lines)


def records(path: Path) -> list[dict]:
  """A JSON-lines file's records; a torn last line (a process killed mid-write) is left out."""
  return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
