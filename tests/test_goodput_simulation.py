"""The goodput planner: exact without failures, Young/Daly's interval where it holds, lower with more failures,
and tools/goodput.py's refusals in one sentence each."""

import dataclasses
import math
import re

import numpy as np
import pytest

from measure import goodput_simulation as sim
from tools import goodput

COSTS = sim.Recovery(detect=10, restart=20, restore=20, recompile=10, relayout=5, save=10, replace_hours=0.5,
                     copy_overhead=0.0)
NEVER_FAILS = sim.Cluster(devices=64, devices_per_host=8, host_mtbf_hours=math.inf)


def test_without_failures_checkpoints_cost_their_saves_and_surviving_costs_nothing():
  run = sim.Run(steps=1000, step_seconds=2.0)
  trials = sim.draw_failures(NEVER_FAILS, trials=3, seed=0)
  # 4 saves: after steps 300, 600 and 900, and after the last step.
  assert list(sim.checkpoint_restart(trials, run, COSTS, every=300).goodput) == [2000.0 / (2000.0 + 4 * 10)] * 3
  assert list(sim.layout_redundancy(trials, NEVER_FAILS, run, COSTS, replica_devices=8).goodput) == [1.0] * 3
  assert list(sim.peer_copies(trials, NEVER_FAILS, run, COSTS, every=50, replica_devices=8).goodput) == [1.0] * 3
  # Swept without failures, the best interval saves only at the end.
  assert sim.best_checkpoint_interval(trials, NEVER_FAILS, run, COSTS).every == 1000


def test_the_best_interval_is_young_dalys_where_its_assumptions_hold():
  # A failure every 10 h on the cluster against a 10 s save and a 60 s restart: sqrt(2 x 10 x 36,000) = 849 s.
  cluster = sim.Cluster(devices=80, devices_per_host=8, host_mtbf_hours=100.0)
  run = sim.Run(steps=5000 * 36_000, step_seconds=1.0)  # about 5,000 failures a trial
  best = sim.best_checkpoint_interval(sim.draw_failures(cluster, trials=8, seed=0), cluster, run, COSTS)
  young_daly = sim.young_daly_seconds(cluster, COSTS)
  assert young_daly == pytest.approx(848.5, abs=0.1)
  assert abs(best.every * run.step_seconds / young_daly - 1) < 0.10, (best.every, young_daly)


def test_more_failures_lower_goodput():
  run = sim.Run(steps=200_000, step_seconds=2.0)
  worse = {}
  for mtbf in (5000.0, 500.0):
    cluster = sim.Cluster(devices=1024, devices_per_host=8, host_mtbf_hours=mtbf)
    costs = dataclasses.replace(COSTS, copy_overhead=0.02)
    outcomes = sim.plan(cluster, run, costs, peer_copy_every=100, replica_devices=8, trials=5, seed=0)
    worse[mtbf] = {outcome.strategy: outcome.goodput.mean() for outcome in outcomes}
  assert worse[5000.0].keys() == {"checkpoint-restart", "survive: layout redundancy", "survive: peer copies"}
  for strategy, fewer in worse[5000.0].items():
    assert worse[500.0][strategy] < fewer < 1, strategy


def test_peer_copies_redo_the_steps_since_the_last_copy():
  # One failure in the whole run, at a time the seed fixes: the run redoes the steps since the last copy.
  cluster = sim.Cluster(devices=64, devices_per_host=8, host_mtbf_hours=8 * 10.0)  # 10 h on the cluster
  run = sim.Run(steps=3600, step_seconds=1.0)
  trials = sim.draw_failures(cluster, trials=200, seed=0)
  costs = dataclasses.replace(COSTS, detect=0, relayout=0, recompile=0, replace_hours=0)
  walls = {every: run.seconds / sim.peer_copies(trials, cluster, run, costs, every, 8).goodput
           for every in (1, 600)}
  failed_once = np.array([trial.first(1)[0] < run.seconds < trial.first(2).sum() - 600 for trial in trials])
  redone = walls[600][failed_once] - walls[1][failed_once]
  lands = np.array([trial.first(1)[0] for trial in trials])[failed_once]
  # With nothing else to pay, one failure costs exactly the work since the last copy (the replica's throughput
  # is back at once): where the failure lands modulo 600, less the partial step a copy every step also redoes.
  assert redone == pytest.approx(lands % 600 - lands % 1, abs=1e-6)
  assert 0 < redone.mean() < 600


def refusal(capsys, flags: list[str]) -> str:
  with pytest.raises(SystemExit) as stopped:
    goodput.parse_args(flags)
  assert stopped.value.code == 2
  return capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1]


SIMULATE = ["--simulate", "--devices=1024", "--hours=720", "--step-seconds=6"]


@pytest.mark.parametrize("flag, named", [
    ("--hours=-5", "argument --hours: -5 will not do; give"),
    ("--hours=0", "argument --hours: 0 will not do; give"),
    ("--step-seconds=nan", "argument --step-seconds: nan will not do; give"),
    ("--devices=1024,abc", "argument --devices: 1024,abc will not do; give"),
    ("--devices=1001", "--devices 1001 is not a whole number of hosts of 8 devices; give"),
    ("--detect-seconds=-1", "argument --detect-seconds: -1 will not do; give"),
    ("--trials=0", "argument --trials: 0 will not do; give"),
    ("--host-mtbf-hours=0", "argument --host-mtbf-hours: 0 will not do; give"),
    ("--copy-overhead=x", "argument --copy-overhead: x will not do; give"),
    ("--replica-devices=2048", "--replica-devices 2048 is more than the 1024 devices of the smallest cluster; give"),
    ("--hours=0.0001", "--hours 0.0001 is less than one step of 6 s; give"),
])
def test_bad_input_is_refused_in_one_sentence_naming_it(capsys, flag, named):
  message = refusal(capsys, [*SIMULATE, flag])
  assert message.startswith(named), message
  assert message.endswith(".") and not re.search(r"\.\s+[A-Z]", message), f"not one sentence: {message}"


def test_without_runs_or_simulate_it_says_what_to_pass(capsys):
  assert refusal(capsys, []).startswith("give either run directories")
  assert "--step-seconds" in refusal(capsys, ["--simulate", "--devices=8", "--hours=1"])


def test_the_table_has_a_row_per_size_and_strategy(capsys):
  goodput.main(SIMULATE[:1] + ["--devices=64,128", "--steps=2000", "--step-seconds=2", "--trials=2"])
  rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d", line)]
  assert [row.split(" | ")[:2] for row in rows] == [
      [f"| {devices}", strategy] for devices in (64, 128)
      for strategy in ("checkpoint-restart", "survive: layout redundancy", "survive: peer copies")]
  assert all(re.search(r"\| [01]\.\d{3} ± 0\.\d{3} \|", row) for row in rows), rows


@pytest.mark.parametrize("flags, named", [
    (["--devices=102400", "--host-mtbf-hours=0.001"], "--devices 102,400 (12,800 hosts at --host-mtbf-hours 0.001)"),
    (["--devices=1024", "--hours=1e12"], "--devices 1,024 (128 hosts at --host-mtbf-hours 6335)"),
    (["--devices=1024", "--trials=1000000"], "--devices 1,024 (128 hosts at --host-mtbf-hours 6335)"),
])
def test_a_simulation_past_its_memory_is_refused_before_it_runs(capsys, flags, named):
  message = refusal(capsys, ["--simulate", "--hours=720", "--step-seconds=6", *flags])
  assert message.startswith(named) and f"more than the {sim.MAX_FAILURES:,} failure times" in message, message
  assert message.endswith(".") and not re.search(r"\.\s+[A-Z]", message), f"not one sentence: {message}"


def test_without_failures_a_long_run_draws_no_more_than_the_first_gaps(capsys):
  goodput.main(["--simulate", "--devices=1024", "--hours=1e12", "--step-seconds=6", "--host-mtbf-hours=inf",
                "--trials=2"])
  assert "| 1,024 | survive: peer copies |" in capsys.readouterr().out
