"""Run a grid of config overrides, one train.py run each, then tabulate and plot them.

  python tools/sweep.py --recipe adamw_vs_l2                       # a recipe from measure/recipes.py
  python tools/sweep.py --grid optimizer.name=adamw,adam_l2 --grid schedule.warmup_steps=0,200 --seeds 0,1
  python tools/sweep.py --recipe adamw_vs_l2 --seeds=5 --baseline=optimizer.name=adamw \
      --baseline=optimizer.weight_decay=0.1                       # 95% intervals, paired tests against that cell
  python tools/sweep.py --recipe schedule --set steps=40 --out runs/sweeps/quick
  python tools/sweep.py --recipe all --write docs             # docs/research.md's tables, docs/*.md and docs/*.png

Each run is a `train.py` subprocess in `<out>/<its fields>`: a mesh fixes the
device count when jax starts, so separate processes are the robust way to
sweep over layouts. A run directory remembers the command that made it; a
finished run is skipped, an interrupted one resumes from its checkpoint, so
running the same sweep again picks up where it stopped. At the end
`<out>/results.md`, `<out>/results.csv` and the loss curves `<out>/loss.png`
(or `--figure`) hold every run; with several seeds `<out>/results_by_cell.md` and `.csv` hold each cell over its
seeds (measure/sweep.py `seeded_rows`). `--write DIR` also puts each recipe's table in
DIR/<recipe>.md, its figure in DIR/<recipe>.png, and the same table and figure
between docs/research.md's `<!-- recipe:NAME -->` markers (or --page's): those
tables are this tool's output, never edited by hand.
"""

import dataclasses
import re
import sys
from pathlib import Path

from absl import app, flags

from measure.doc_blocks import replace_block
from measure.recipes import RECIPES, Recipe
from measure.sweep import ROOT, check_runs, parse_grid, parse_set, sweep, write_docs

_RECIPE = flags.DEFINE_enum("recipe", None, [*RECIPES, "all"], "A recipe from measure/recipes.py, or all.")
_CONFIG = flags.DEFINE_string("config", "configs/gpt2.py:tiny", "Base config and variant (without --recipe).")
_GRID = flags.DEFINE_multi_string("grid", [], "field=v1,v2,...: one axis of the grid (repeat for more).")
_SET = flags.DEFINE_multi_string("set", [], "field=value for every run (repeat for more).")
_SEEDS = flags.DEFINE_list("seeds", [], "N (seeds 0 to N-1) or a comma list of seeds, each a run of every grid "
                           "point; with several, a table per cell of means, 95% intervals and paired tests.")
_SEED_FIELD = flags.DEFINE_enum("seed_field", None, ["seed", "data.seed"], "What --seeds varies: seed (the initial "
                                "weights and the data order) or data.seed (the order alone); default the recipe's.")
_MATCH = flags.DEFINE_string("match", None, "Hold every run's tokens, training FLOPs or modelled seconds on one "
                             "device of a kind (seconds@h100) to --budget: each run's steps follow from its batch "
                             "and model.")
_BUDGET = flags.DEFINE_float("budget", None, "With --match: the tokens, FLOPs or seconds each run spends.")
_BASELINE = flags.DEFINE_multi_string("baseline", [], "field=value naming the cell the others are compared with "
                                      "(repeat for more fields); default the first cell.")
_BEST_WITHIN = flags.DEFINE_string("best_within", None, "A varied field: compare each cell with the best cell that "
                                   "differs from it in this field alone (is a best learning rate resolved?), not "
                                   "with the baseline.")
_DEVICES = flags.DEFINE_integer("devices", None, "Simulated CPU devices per run.")
_OUT = flags.DEFINE_string("out", None, "Sweep directory; default runs/sweeps/<recipe or 'sweep'> (with "
                           "--write, runs/docs/<recipe>). With --recipe=all, the folder of one per recipe.")
_FIGURE = flags.DEFINE_string("figure", None, "Where the loss curves go; default <out>/loss.png.")
_WRITE = flags.DEFINE_string("write", None, "With --recipe: write <this folder>/<recipe>.md and .png, and "
                             "rewrite the recipe's <!-- recipe:NAME --> block in --page.")
_PAGE = flags.DEFINE_string("page", str(ROOT / "docs" / "research.md"), "The file whose blocks --write rewrites.")


def recipes_from_flags() -> list[Recipe]:
  """The recipes to run, each with the command line's changes."""
  if _RECIPE.value == "all":
    chosen = list(RECIPES.values())
  else:
    chosen = [RECIPES[_RECIPE.value] if _RECIPE.value else Recipe("sweep", "", config=_CONFIG.value)]
  changes = {}
  if _GRID.value:
    changes.update(grid=parse_grid(_GRID.value), cases=())
  if _SEEDS.value:
    if not all(re.fullmatch(r"-?\d+", s) for s in _SEEDS.value):
      raise ValueError(f"--seeds={','.join(_SEEDS.value)} is not a count or a list of integers, e.g. --seeds=5 "
                       "or --seeds=0,1,2")
    seeds = tuple(int(s) for s in _SEEDS.value)
    if len(seeds) == 1 and seeds[0] < 1:
      raise ValueError(f"--seeds={seeds[0]} runs no seed; give a count of at least 1 (seeds 0 to N-1) or a list.")
    changes["seeds"] = tuple(range(seeds[0])) if len(seeds) == 1 else seeds
  if _MATCH.value or _BUDGET.value is not None:
    changes.update(match=_MATCH.value or "", budget=_BUDGET.value or 0.0)
  if _SEED_FIELD.value:
    changes["seed_field"] = _SEED_FIELD.value
  if _BASELINE.value:
    changes["baseline"] = parse_set(_BASELINE.value, "--baseline")
  if _BEST_WITHIN.value:
    changes["best_within"] = _BEST_WITHIN.value
  if _DEVICES.value is not None:
    if _DEVICES.value < 1:
      raise ValueError(f"--devices={_DEVICES.value} must be at least 1 (simulated CPU devices per run).")
    changes["devices"] = _DEVICES.value
  return [dataclasses.replace(r, fixed={**r.fixed, **parse_set(_SET.value)}, **changes) for r in chosen]


def sweep_dir(recipe: Recipe) -> Path:
  """Where a recipe's runs go: --out, or one folder per recipe under it (--recipe=all) or under the default."""
  if _OUT.value:
    return Path(_OUT.value) / recipe.name if _RECIPE.value == "all" else Path(_OUT.value)
  return Path("runs/docs" if _WRITE.value else "runs/sweeps") / recipe.name


def check_write(recipes: list[Recipe]) -> None:
  """Refuse --write where the docs would not be a recipe's, before any run starts (not after an hour)."""
  changed = (_GRID.value, _SEEDS.value, _SEED_FIELD.value, _BASELINE.value, _MATCH.value, _BUDGET.value is not None,
             _BEST_WITHIN.value, _DEVICES.value, _FIGURE.value)
  if not _RECIPE.value or any(changed):
    raise ValueError("--write takes --recipe (a name or all) and --set only: the docs hold the recipes' runs, "
                     "and each figure goes to <folder>/<recipe>.png.")
  page = Path(_PAGE.value).read_text()
  for recipe in recipes:
    try:
      replace_block(page, f"recipe:{recipe.name}", "")
    except ValueError as error:
      raise ValueError(f"{_PAGE.value}: {error}") from None


def docs_command(recipe: Recipe) -> str:
  """The command that regenerates one recipe's docs, as the docs quote it."""
  sets = "".join(f" --set={entry}" for entry in _SET.value)
  page = Path(_PAGE.value).resolve()
  elsewhere = "" if page == (ROOT / "docs" / "research.md").resolve() else f" --page={page.relative_to(ROOT)}"
  return f"python tools/sweep.py --recipe={recipe.name}{sets} --write={_WRITE.value}{elsewhere}"


def run_recipe(recipe: Recipe) -> None:
  out = sweep_dir(recipe)
  if not _WRITE.value:
    print(sweep(recipe, out, Path(_FIGURE.value) if _FIGURE.value else None), end="")
    print(f"tables in {out}/results.md and results.csv, curves in {_FIGURE.value or out / 'loss.png'}")
    return
  docs = Path(_WRITE.value)
  table = sweep(recipe, out, docs / f"{recipe.name}.png")
  print(table, end="")
  if len(recipe.seeds) > 1:  # the docs show each cell over its seeds; every run's own row stays in results.md
    table = (out / "results_by_cell.md").read_text()
  write_docs(recipe, table, docs, Path(_PAGE.value), docs_command(recipe))
  print(f"wrote {docs / recipe.name}.md and .png, and its block in {_PAGE.value}")


def main(argv):
  del argv
  try:
    recipes = recipes_from_flags()
    if _WRITE.value:
      check_write(recipes)
    for recipe in recipes:
      check_runs(recipe, sweep_dir(recipe))
    for recipe in recipes:
      run_recipe(recipe)
  except (ValueError, RuntimeError) as error:
    sys.exit(f"error: {error}")


if __name__ == "__main__":
  app.run(main)
