"""tools/sweep.py without training: recipes name real fields, finished runs are skipped, changed ones refused.

The notebooks' test runs a real sweep end to end (tests/test_notebooks.py).
"""

import dataclasses
import importlib
import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import markdown_tables
from measure import calibration, hardware, seed_stats, step_time, sweep
from measure.dry_run import model_weights
from measure.recipes import RECIPES, WSD_STABLE, Recipe
from parallel.mesh import AXES


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
  order_only = dataclasses.replace(recipe, seed_field="data.seed").runs()  # the weights' seed left as configured
  assert order_only[1] == {"optimizer.name": "adamw", "schedule.warmup_steps": "0", "data.seed": 1}
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


def test_the_wsd_recipe_branches_each_seed_from_its_own_stable_run(tmp_path):
  recipe = RECIPES["wsd"]
  runs = recipe.runs()
  stable = [fields for fields in runs if fields["steps"] == 200]
  assert [sweep.run_name(fields) for fields in stable] == [WSD_STABLE.format(seed=seed) for seed in recipe.seeds]
  for fields in runs:
    if fields["branch_from"]:
      command = sweep.train_command(recipe, fields, tmp_path / sweep.run_name(fields))
      step = 60 if fields["steps"] == 80 else 100
      assert f"--config.branch_from={tmp_path / WSD_STABLE.format(seed=fields['seed'])}:{step}" in command
  # The tables name the stable run's row: the run's own seed's, or in the table of cells the first seed's.
  branched = next(fields for fields in runs if fields["branch_from"] and fields["seed"] == 2)
  assert sweep._shown(branched["branch_from"], runs, "seed", 2) == "row 3, step 60"
  assert sweep._shown(branched["branch_from"], runs, "seed") == "row 1 (each seed its own), step 60"


# Final validation losses of a 2-cell, 5-seed sweep; scipy 1.17.1 (the sidecar venv) gives for them
# stats.ttest_rel(b, a) = (4.080490963605366, p 0.015092344138614103), stats.t.ppf(0.975, 4) = 2.7764451051977934.
BASELINE_LOSSES, OTHER_LOSSES = (1.0, 1.2, 0.9, 1.1, 1.05), (1.1, 1.25, 1.0, 1.12, 1.1)


def finished_sweep(recipe, out, losses, train_losses=None):
  """`recipe`'s runs in `out` as finished runs that logged the given final validation losses (run i: losses[i])
  and train losses (train_losses[i], logged 10 steps apart; default one, 0.1 above the validation loss)."""
  for i, (fields, loss) in enumerate(zip(recipe.runs(), losses)):
    workdir = out / sweep.run_name(fields)
    workdir.mkdir(parents=True)
    (workdir / sweep.MARKER).write_text(json.dumps({"command": sweep.train_command(recipe, fields, workdir),
                                                    "finished": True, "seconds": 1.0}))
    logged = train_losses[i] if train_losses else [loss + 0.1]
    records = [{"step": 10 * (j + 1), "loss": x, "tokens_per_sec": 1.0} for j, x in enumerate(logged)]
    records.append({"step": 10 * len(logged), "eval_loss": loss})
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


def test_best_within_compares_each_cell_with_the_best_of_its_row_group(tmp_path):
  # Width 64: the rate 2e-3 is best; width 128: 1e-3. Each cell is compared with its own width's best.
  recipe = Recipe("t", "", grid=sweep.parse_grid(["model.embed_dim=64,128", "optimizer.lr=1e-3,2e-3"]),
                  seeds=tuple(range(5)), best_within="optimizer.lr", versus="optimizer.lr")
  worse = tuple(x + 0.1 for x in OTHER_LOSSES)
  finished_sweep(recipe, tmp_path, [*worse, *OTHER_LOSSES, *BASELINE_LOSSES, *worse])
  sweep.sweep(recipe, tmp_path)
  (slow_64, best_64, best_128, slow_128), = markdown_tables((tmp_path / "results_by_cell.md").read_text())
  column = "vs best optimizer.lr alike otherwise, ± 95% CI"
  assert best_64[column] == best_128[column] == "best"
  assert slow_64[column] == "+0.1000 ± 0.0000" and slow_64["p < 0.05"] == "yes"
  differences = np.subtract(worse, BASELINE_LOSSES)
  assert slow_128[column] == (
      f"{differences.mean():+.4f} ± {2.7764451051977934 * np.std(differences, ddof=1) / 5 ** 0.5:.4f}")
  assert (tmp_path / "loss.png").stat().st_size > 0  # a line per width, each point a mean with its interval
  with pytest.raises(ValueError, match=r"best_within='optimizer.b1' is not a field the sweep varies; name one of "
                                       "model.embed_dim, optimizer.lr"):
    sweep.check_runs(dataclasses.replace(recipe, best_within="optimizer.b1"), tmp_path)


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


def test_compute_matching_gives_each_run_the_steps_its_budget_buys(tmp_path):
  grid = sweep.parse_grid(["batch_size=4,8", "model.num_layers=2,4"])
  by_tokens = Recipe("t", "", grid=grid, match="tokens", budget=512 * 128 * 10)
  steps = {(f["batch_size"], f["model.num_layers"]): sweep.matched_steps(by_tokens, f, tmp_path)["steps"]
           for f in by_tokens.runs()}
  assert steps == {("4", "2"): 1280, ("4", "4"): 1280, ("8", "2"): 640, ("8", "4"): 640}  # 128 tokens a row
  by_flops = dataclasses.replace(by_tokens, match="flops", budget=1e13)
  # The whole step's textbook FLOPs (measure/flops.py ideal_flops, held to hand arithmetic in test_estimate.py).
  cost = {(f["batch_size"], f["model.num_layers"]): sweep.step_cost("flops", sweep.run_config(by_flops, f, tmp_path))
          for f in by_flops.runs()}
  for fields in by_flops.runs():
    assert sweep.matched_steps(by_flops, fields, tmp_path) == {
        "steps": int(1e13 // cost[fields["batch_size"], fields["model.num_layers"]])}
  assert cost["8", "2"] == 2 * cost["4", "2"]  # twice the tokens
  assert 1.5 < cost["4", "4"] / cost["4", "2"] < 2  # twice the layers, the same head: less than twice the FLOPs
  command = sweep.train_command(by_tokens, by_tokens.runs()[0], tmp_path / "run")
  assert "--config.steps=1280" in command
  with pytest.raises(ValueError, match=r"a budget of 100 tokens buys no step \(the first costs 512\)"):
    sweep.check_runs(dataclasses.replace(by_tokens, budget=100), tmp_path)
  with pytest.raises(ValueError, match="leave steps out of the grid"):
    sweep.check_runs(Recipe("t", "", grid=sweep.parse_grid(["steps=10,20"]), match="tokens", budget=1e6), tmp_path)


def test_a_long_run_name_is_cut_and_told_apart_by_a_digest():
  long = {"curriculum": "40:batch_size=4,model.max_len=64,model.sliding_window=32;80:model.sliding_window=64" * 3}
  names = {sweep.run_name({**long, "seed": seed}) for seed in range(3)}
  assert len(names) == 3 and all(len(name) == sweep.MAX_NAME for name in names)
  assert sweep.run_name({"seed": 0}) == "seed=0"


def test_compute_matching_and_tokens_to_target_follow_a_curriculum(tmp_path):
  # 100 steps at batch 2 before the config's own 4 (128 positions a row): the budget buys 100 + 150 steps.
  ramp = Recipe("t", "", fixed={"batch_size": 4, "curriculum": "100:batch_size=2"}, match="tokens",
                budget=128 * (100 * 2 + 150 * 4), target_loss=2.0, seeds=(0, 1))
  fields = ramp.runs()[0]
  assert sweep.matched_steps(ramp, fields, tmp_path) == {"steps": 250}
  losses = [3.0] * 11 + [2.0] * 3  # logged every 10 steps: the 3-log mean reaches 2.0 at step 140
  finished_sweep(ramp, tmp_path, [1.0, 1.0], [losses, losses])
  assert sweep.tokens_to_target(tmp_path / sweep.run_name(fields), 2.0, lambda step: step) == 140
  sweep.sweep(ramp, tmp_path)
  (row,), = markdown_tables((tmp_path / "results_by_cell.md").read_text())
  assert row["tokens to loss 2.0 (3-log mean), mean ± 95% CI"] == f"{128 * (100 * 2 + 40 * 4):,} ± 0"


def test_time_matching_gives_each_run_the_steps_its_modelled_seconds_buy(tmp_path):
  kind = next(iter(calibration.REFERENCES))
  # The step-time model has bfloat16's and fp8's peaks, not float32's (measure/step_time.py peak_flops).
  by_time = Recipe("t", "", grid=sweep.parse_grid(["model.num_layers=2,4"]), fixed={"precision.compute": "bfloat16"},
                   match=f"seconds@{kind}", budget=60.0)
  seconds = {}
  for fields in by_time.runs():
    config = sweep.run_config(by_time, fields, tmp_path)
    modelled = step_time.predict(config, {axis: 1 for axis in AXES}, {}, hardware.cluster(kind, 1),
                                 model_weights(config), calibration.achievable_fraction(kind)).step
    seconds[fields["model.num_layers"]] = sweep.step_cost(by_time.match, config)
    assert seconds[fields["model.num_layers"]] == modelled
    assert sweep.matched_steps(by_time, fields, tmp_path) == {"steps": int(60.0 // modelled)}
  assert seconds["4"] > seconds["2"]  # the deeper model's step takes longer: fewer steps in the same time
  for match in ("seconds", "seconds@abacus", "minutes@h100"):
    with pytest.raises(ValueError, match=rf"match='{match}' is not one of tokens, flops or seconds@<kind>"):
      sweep.check_runs(dataclasses.replace(by_time, match=match), tmp_path)


def test_tokens_to_target_come_with_their_interval_over_seeds(tmp_path):
  recipe = Recipe("t", "", grid=sweep.parse_grid(["batch_size=4,8"]), seeds=(0, 1, 2), target_loss=2.0)
  # The mean of three logged losses first reaches 2.0 at the third log (2.5, 2.0, 1.5), the fourth or never.
  fast, slow, never = [2.5, 2.0, 1.5, 1.0], [3.0, 2.5, 1.5, 1.5], [3.0, 3.0, 3.0, 3.0]
  finished_sweep(recipe, tmp_path, [1.0] * 6, [fast, slow, fast, never, fast, fast])
  sweep.sweep(recipe, tmp_path)
  (four, eight), = markdown_tables((tmp_path / "results_by_cell.md").read_text())
  column = "tokens to loss 2.0 (3-log mean), mean ± 95% CI"
  tokens = np.array([30, 40, 30]) * 4 * 128  # steps 30, 40 and 30 at 512 tokens a step
  assert four[column] == f"{tokens.mean():,.0f} ± {4.302652729749462 * tokens.std(ddof=1) / 3 ** 0.5:,.0f}"
  assert eight[column] == "2 of 3 seeds"  # one seed never reached it: no interval over the others alone


def test_a_cumulative_recipe_compares_each_row_with_the_one_before(tmp_path):
  recipe = Recipe("t", "", grid=sweep.parse_grid(["optimizer.lr=1e-3,2e-3,3e-3"]), seeds=tuple(range(5)),
                  cumulative=True)
  third = tuple(x - 0.2 for x in OTHER_LOSSES)
  finished_sweep(recipe, tmp_path, [*BASELINE_LOSSES, *OTHER_LOSSES, *third])
  sweep.sweep(recipe, tmp_path)
  (first, second, last), = markdown_tables((tmp_path / "results_by_cell.md").read_text())
  assert first["vs previous row, ± 95% CI"] == "baseline"
  assert second["p (paired t)"] == f"{0.015092344138614103:.3g}"  # against the first, as above
  # The third moved every seed by -0.2 from the second: no spread, and p = 0 (a certain difference).
  assert last["vs previous row, ± 95% CI"] == "-0.2000 ± 0.0000" and last["p < 0.05"] == "yes"


def test_runs_that_differ_in_their_seed_share_one_compiled_step(tmp_path):
  recipe = Recipe("t", "", seeds=(0, 1), fixed={"steps": 2, "eval_every": 0, "sample_tokens": 0,
                                                 "checkpoint.every": 0, "model.num_layers": 1})
  cache = tmp_path / sweep.COMPILATION_CACHE
  entries = []
  for fields in recipe.runs():
    workdir = tmp_path / sweep.run_name(fields)
    assert sweep.run_one(sweep.train_command(recipe, fields, workdir), workdir, devices=1)["finished"]
    entries.append({p.name for p in cache.iterdir() if p.name.startswith("jit_train_step")})
  # The first run compiled its step into the sweep's cache; the second, another seed, found it there.
  assert len(entries[0]) == 1 and entries[1] == entries[0]
