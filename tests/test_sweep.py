"""tools/sweep.py without training: recipes name real fields, finished runs are skipped, changed ones refused.

The notebooks' test runs a real sweep end to end (tests/test_notebooks.py).
"""

import importlib
import json
import subprocess
import sys

import pytest

from measure import sweep
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
    (["--seeds=0,x"], "--seeds=0,x is not a list of integers"),
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
