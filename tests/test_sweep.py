"""tools/sweep.py without training: recipes name real fields, finished runs are skipped, changed ones refused.

The notebooks' test runs a real sweep end to end (tests/test_notebooks.py).
"""

import importlib
import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import markdown_tables
from measure import seed_stats, sweep
from measure.recipes import RECIPES, WSD_STABLE, Recipe


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_name_only_fields_the_config_has(name):
  recipe = RECIPES[name]
  path, variant = recipe.config.split(":")
  config = importlib.import_module(path.removesuffix(".py").replace("/", ".")).get_config(variant)
  for fields in recipe.runs():
    for field in {**recipe.fixed, **fields}:
      node = config
      for part in field.split("."):
        assert part in node, f"{name}: no config field {field}"
        node = node[part]


def test_grid_runs_every_combination_for_every_seed():
  recipe = Recipe("t", "", grid=sweep.parse_grid(["optimizer.name=adamw,adam_l2", "schedule.warmup_steps=0,200"]),
                  seeds=(0, 1))
  runs = recipe.runs()
  assert len(runs) == 8 and runs[0] == {"optimizer.name": "adamw", "schedule.warmup_steps": "0", "seed": 0}
  assert len({sweep.run_name(r) for r in runs}) == 8  # one directory each
  with pytest.raises(ValueError, match="is not field=value1,value2"):
    sweep.parse_grid(["optimizer.name"])


def test_finished_runs_are_skipped_and_changed_ones_refused(tmp_path):
  fails_if_run = [sys.executable, "-c", "raise SystemExit(3)"]
  (tmp_path / sweep.MARKER).write_text(json.dumps({"command": fails_if_run, "finished": True}))
  assert sweep.run_one(fails_if_run, tmp_path, devices=1)["skipped"]
  with pytest.raises(ValueError, match="holds a run made by another command"):
    sweep.run_one([sys.executable, "-c", "pass"], tmp_path, devices=1)


def test_an_unfinished_run_runs_again_and_a_failure_is_recorded(tmp_path):
  command = [sys.executable, "-c", "raise SystemExit(3)"]
  (tmp_path / sweep.MARKER).write_text(json.dumps({"command": command, "finished": False}))
  marker = sweep.run_one(command, tmp_path, devices=1)
  assert not marker["finished"] and "skipped" not in marker
  assert json.loads((tmp_path / sweep.MARKER).read_text())["finished"] is False


@pytest.mark.parametrize("fixed, grid, says", [
    ({}, ["nofield=1,2"], r"run nofield=1,seed=0: the config has no field 'nofield'"),
    ({}, ["optimizer.lr=1e-3,fast"], r"run optimizer.lr=fast,seed=0: optimizer.lr='fast' is not a number"),
    ({"mesh.data": "2"}, ["optimizer.b1=0.9,1.2"], r"run optimizer.b1=1.2,seed=0: optimizer.b1=1.2 must be in"),
])
def test_a_bad_run_is_refused_before_any_run_starts(fixed, grid, says, tmp_path):
  recipe = Recipe("t", "", fixed=fixed, grid=sweep.parse_grid(grid))
  with pytest.raises(ValueError, match=says):
    sweep.check_runs(recipe, tmp_path)


@pytest.mark.parametrize("args, says", [
    (["--seeds=0,x"], "--seeds=0,x is not a count or a list of integers"),
    (["--seeds=0"], "--seeds=0 runs no seed"),
    (["--baseline=lr"], "--baseline 'lr' is not field=value"),
    (["--devices=0"], "--devices=0 must be at least 1"),
])
def test_bad_sweep_flags_are_one_line(args, says):
  result = subprocess.run([sys.executable, "tools/sweep.py", *args], cwd=sweep.ROOT, capture_output=True,
                          text=True, timeout=120)
  message = result.stderr.strip()
  assert result.returncode == 1 and message.startswith(f"error: {says}") and "\n" not in message, message


def test_the_wsd_recipe_branches_from_its_own_stable_run(tmp_path):
  recipe = RECIPES["wsd"]
  stable, *others = recipe.runs()
  assert sweep.run_name(stable) == WSD_STABLE
  branched = [sweep.train_command(recipe, fields, tmp_path / sweep.run_name(fields)) for fields in others
              if fields["branch_from"]]
  assert [c for command in branched for c in command if c.startswith("--config.branch_from=")] == [
      f"--config.branch_from={tmp_path / WSD_STABLE}:60", f"--config.branch_from={tmp_path / WSD_STABLE}:100"]


# Final validation losses of a 2-cell, 5-seed sweep; scipy 1.17.1 (the sidecar venv) gives for them
# stats.ttest_rel(b, a) = (4.080490963605366, p 0.015092344138614103), stats.t.ppf(0.975, 4) = 2.7764451051977934.
BASELINE_LOSSES, OTHER_LOSSES = (1.0, 1.2, 0.9, 1.1, 1.05), (1.1, 1.25, 1.0, 1.12, 1.1)


def finished_sweep(recipe, out, losses):
  """`recipe`'s runs in `out` as finished runs that logged the given final losses (run i: losses[i])."""
  for fields, loss in zip(recipe.runs(), losses):
    workdir = out / sweep.run_name(fields)
    workdir.mkdir(parents=True)
    (workdir / sweep.MARKER).write_text(json.dumps({"command": sweep.train_command(recipe, fields, workdir),
                                                    "finished": True, "seconds": 1.0}))
    records = [{"step": 10, "loss": loss + 0.1, "tokens_per_sec": 1.0}, {"step": 10, "eval_loss": loss}]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_seeded_sweep_gives_each_cell_its_interval_and_a_paired_test_against_the_baseline(tmp_path):
  recipe = Recipe("t", "", grid=sweep.parse_grid(["optimizer.lr=1e-3,2e-3"]), seeds=tuple(range(5)),
                  baseline={"optimizer.lr": "1e-3"})
  finished_sweep(recipe, tmp_path, [*BASELINE_LOSSES, *OTHER_LOSSES])  # the grid's order: seeds vary fastest
  sweep.sweep(recipe, tmp_path)
  (base, other), = markdown_tables((tmp_path / "results_by_cell.md").read_text())
  mean, sd = np.mean(OTHER_LOSSES), np.std(OTHER_LOSSES, ddof=1)
  assert other["final val loss, mean ± 95% CI"] == f"{mean:.4f} ± {2.7764451051977934 * sd / 5 ** 0.5:.4f}"
  assert base["vs baseline, ± 95% CI"] == "baseline" and base["optimizer.lr"] == "1e-3"
  differences = np.subtract(OTHER_LOSSES, BASELINE_LOSSES)
  assert other["vs baseline, ± 95% CI"] == (
      f"{differences.mean():+.4f} ± {2.7764451051977934 * np.std(differences, ddof=1) / 5 ** 0.5:.4f}")
  assert other["p (paired t)"] == f"{0.015092344138614103:.3g}" and other["p < 0.05"] == "yes"
  # The interval's half-width (0.0435) is below the difference (0.064) from 4 seeds on: t(0.975, 2) = 4.30 needs 5.
  assert other["seeds to resolve"] == "4"


@pytest.mark.parametrize("baseline, says", [({"optimizer.lr": "3e-3"}, "matches no cells"),
                                             ({"optimizer.b1": "0.9"}, "matches 2 cells")])
def test_a_baseline_not_one_cell_is_refused_before_any_run_starts(baseline, says, tmp_path):
  recipe = Recipe("t", "", grid=sweep.parse_grid(["optimizer.lr=1e-3,2e-3", "optimizer.b1=0.9"]), seeds=(0, 1),
                  baseline=baseline)
  with pytest.raises(ValueError, match=rf"baseline .* {says} of 't'; name field=value pairs"):
    sweep.check_runs(recipe, tmp_path)


@pytest.mark.parametrize("p, t, df", [(0.06676654481198814, 2.5, 4), (0.34089313230206, 1.0, 10),
                                      (0.02667147321542477, 6.0, 2)])
def test_students_t_is_scipys(p, t, df):
  # Reference values: scipy 1.17.1's 2 * stats.t.sf(t, df) and stats.t.ppf.
  assert seed_stats.t_two_sided_p(t, df) == pytest.approx(p, rel=1e-12)
  assert seed_stats.t_quantile(1 - p / 2, df) == pytest.approx(t, rel=1e-9)
