"""A sweep's runs: one train.py process each, in its own folder, skipped when finished and resumed when
interrupted; then the results table, the loss curves and a recipe's docs block (tools/sweep.py is its command line).

Each run is a `train.py` subprocess in `<out>/<its fields>`: a mesh fixes the device count when jax
starts, so separate processes are the robust way to sweep over layouts. A run directory remembers the
command that made it (MARKER), so running the same sweep again picks up where it stopped.
"""

import csv
import functools
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

from configs import load
from measure import calibration, hardware, seed_stats, step_time
from measure.doc_blocks import replace_block
from measure.recipes import Recipe
from measure.dry_run import model_weights
from measure.flops import ideal_flops
from measure.sizes import run_of
from parallel.mesh import AXES
from training import curriculum
from training.state import model_config
from training.validate import check_run

ROOT = Path(__file__).resolve().parent.parent  # train.py runs from the repository's root

MARKER = "sweep_run.json"  # in each run directory: the command that made it and whether it finished
COMPILATION_CACHE = "compilation_cache"  # in the sweep's folder: the runs' compiled programs, shared between them


def parse_grid(entries: list[str]) -> tuple:
  """`field=v1,v2` entries as ((field, (v1, v2)), ...)."""
  grid = []
  for entry in entries:
    field, _, values = entry.partition("=")
    if not field or not values:
      raise ValueError(f"--grid {entry!r} is not field=value1,value2,...")
    grid.append((field, tuple(values.split(","))))
  return tuple(grid)


def parse_set(entries: list[str], flag: str = "--set") -> dict:
  fixed = {}
  for entry in entries:
    field, eq, value = entry.partition("=")
    if not field or not eq:
      raise ValueError(f"{flag} {entry!r} is not field=value")
    fixed[field] = value
  return fixed


MAX_NAME = 200  # characters of a run's directory name; file systems take 255 bytes


def run_name(fields: dict) -> str:
  """A directory name that says what the run varies, e.g. `optimizer.name=adamw,seed=0`; a longer one than
  MAX_NAME cut there and told apart by a digest of the whole."""
  name = re.sub(r"[^\w.=,+-]", "_", ",".join(f"{k}={v}" for k, v in fields.items()))
  if len(name) <= MAX_NAME:
    return name
  return f"{name[:MAX_NAME - 13]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


# What compute matching holds equal: tokens, training FLOPs, or ("seconds@h100", matched_kind) seconds as
# measure/step_time.py models a step on one device of a calibrated kind: the wall time a run would take there.
MATCHES = ("tokens", "flops")
SMOOTHING = 3  # logged train losses averaged where tokens-to-target is read
BALANCE_COLUMNS = ("load CV", "E x sum f P")  # expert_balance's


def _resolved(recipe: Recipe, fields: dict, value, workdir: Path) -> str:
  """A field's value for the run with `fields`: `{out}` is the sweep's folder and `{seed}` the run's seed (a branch
  names a sibling run, of its own seed)."""
  return str(value).replace("{out}", str(workdir.parent)).replace("{seed}", str(fields.get(recipe.seed_field, "")))


def run_config(recipe: Recipe, fields: dict, workdir: Path):
  """The config of the run with `fields`, as its train.py command sets it (without compute matching's steps)."""
  config = load.set_fields(load.load(recipe.config), {"workdir": str(workdir)})
  for field, value in {**recipe.fixed, **fields}.items():
    load.override(config, field, _resolved(recipe, fields, value, workdir))
  return config


def tokens_per_step(config) -> int:
  """Tokens one train step reads (a preference pair's two answers counted apart, as the estimator counts them)."""
  return run_of(config).batch_size * model_config(config).max_len


def matched_kind(match: str) -> str | None:
  """The device kind of a "seconds@<kind>" match, checked against the calibrated kinds; None for tokens or FLOPs;
  an unknown match refused."""
  if match in MATCHES:
    return None
  name, at, kind = match.partition("@")
  if name != "seconds" or not at or kind not in calibration.REFERENCES:
    raise ValueError(f"match={match!r} is not one of tokens, flops or seconds@<kind> with a calibrated kind "
                     f"({', '.join(f'seconds@{k}' for k in calibration.REFERENCES)}).")
  return kind


def step_cost(match: str, config) -> float:
  """What one step of `config` spends on one device: its tokens; the textbook's training FLOPs of the whole step
  (6N per token plus attention's, measure/flops.py ideal_flops); or for "seconds@<kind>" the step's seconds on one
  device of that kind as measure/step_time.py models it, at the kind's calibrated fraction of peak."""
  if match == "tokens":
    return tokens_per_step(config)
  one_device, kind = {axis: 1 for axis in AXES}, matched_kind(match)
  if kind is None:
    return ideal_flops(config, one_device, model_weights(config))
  return step_time.predict(config, one_device, {}, hardware.cluster(kind, 1), model_weights(config),
                           calibration.achievable_fraction(kind)).step


def matched_steps(recipe: Recipe, fields: dict, workdir: Path) -> dict:
  """{"steps": the steps that spend recipe.budget of recipe.match} for the run with `fields`; {} without matching."""
  if not recipe.match:
    return {}
  phases = curriculum.phases(run_config(recipe, fields, workdir))  # a curriculum's first steps cost less
  steps = curriculum.steps_within(phases, recipe.budget, lambda phase: step_cost(recipe.match, phase))
  if steps < 1:
    raise ValueError(f"a budget of {recipe.budget:g} {recipe.match} buys no step (the first costs "
                     f"{step_cost(recipe.match, phases[0].config):.3g}); raise --budget.")
  return {"steps": steps}


def train_command(recipe: Recipe, fields: dict, workdir: Path) -> list[str]:
  """The run's train.py command, its values resolved (`_resolved`)."""
  chosen = {**recipe.fixed, **fields, **matched_steps(recipe, fields, workdir)}
  settings = {k: _resolved(recipe, fields, v, workdir) for k, v in chosen.items()}
  return [sys.executable, str(ROOT / "train.py"), f"--config={recipe.config}",
          *(f"--config.{k}={v}" for k, v in settings.items()), f"--config.workdir={workdir}",
          f"--config.wandb.group={recipe.name}"]  # a sweep's runs side by side when W&B is on


def device_env(devices: int, compilation_cache: Path) -> dict:
  """This environment with the simulated CPU device count set to `devices` (GPUs and TPUs ignore it), and jax's
  persistent compilation cache in `compilation_cache`: a sweep's runs that differ only in their seed (or in any
  setting the compiled step does not read) compile their step once between them, the others loading it."""
  others = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
  return dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(compilation_cache),
              # a tiny model's programs too, which compile in well under jax's default threshold of a second
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
              XLA_FLAGS=" ".join([*others, f"--xla_force_host_platform_device_count={devices}"]))


def run_one(command: list[str], workdir: Path, devices: int) -> dict:
  """Run (or resume, or skip) one training run; returns its marker."""
  marker_path = workdir / MARKER
  marker = json.loads(marker_path.read_text()) if marker_path.exists() else None
  if marker is not None and marker["command"][1:] != command[1:]:
    raise ValueError(f"{workdir} holds a run made by another command; delete it or choose another --out.")
  if marker is not None and marker["finished"]:
    return {**marker, "skipped": True}
  workdir.mkdir(parents=True, exist_ok=True)
  marker = {"command": command, "finished": False}
  marker_path.write_text(json.dumps(marker, indent=1))
  started = time.perf_counter()
  with open(workdir / "train.log", "a") as log:
    process = subprocess.Popen(command, cwd=ROOT, env=device_env(devices, workdir.parent / COMPILATION_CACHE),
                               stdout=log, stderr=log)
    _, status, usage = os.wait4(process.pid, 0)  # the child's own peak host memory comes with it
  marker.update(finished=os.waitstatus_to_exitcode(status) == 0, seconds=time.perf_counter() - started,
                max_rss_mib=usage.ru_maxrss / 1024)
  marker_path.write_text(json.dumps(marker, indent=1))
  return marker


def read_metrics(workdir: Path) -> tuple[list[dict], list[dict]]:
  """(train records, eval records) from a run's metrics.jsonl."""
  path = workdir / "metrics.jsonl"
  records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
  return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


def summarize(workdir: Path, marker: dict) -> dict:
  """The table's numbers for one run; throughput skips the first interval (warm-up)."""
  train, evals = read_metrics(workdir)
  steady = train[1:] or train
  mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
  peak = train[-1].get("peak_bytes") if train else None
  return {
      "final train loss": f"{train[-1]['loss']:.4f}" if train else "failed",
      "final val loss": f"{evals[-1]['eval_loss']:.4f}" if evals else "",
      "tokens/s": f"{statistics.median(r['tokens_per_sec'] for r in steady):,.0f}" if steady else "",
      "MFU": f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a",
      "peak MiB/device": f"{peak / 2**20:.1f}" if peak else "",
      "wall s": f"{marker.get('seconds', 0):.0f}",
  }


def tokens_to_target(workdir: Path, target: float, tokens_through: Callable[[int], float]) -> int | None:
  """The tokens read by the first logged step where the mean of the last SMOOTHING logged train losses is at most
  `target` (tokens_through(step) read by then), or None where it never is."""
  losses, _ = read_metrics(workdir)
  for i in range(SMOOTHING - 1, len(losses)):
    if statistics.mean(r["loss"] for r in losses[i - SMOOTHING + 1:i + 1]) <= target:
      return int(tokens_through(losses[i]["step"]))
  return None


def steps_to(workdir: Path, target: float) -> str:
  """The first logged step whose train loss is at most `target` (log_every apart), or "not reached"."""
  train, _ = read_metrics(workdir)
  return next((str(r["step"]) for r in train if r["loss"] <= target), "not reached")


def expert_balance(workdir: Path) -> dict:
  """How evenly a MoE run chose its experts over its second half, as table columns: the coefficient of
  variation (std / mean) of the experts' shares of the choices (averaged over the layers, then over the logged
  steps; 0 is even), and the balance figure E x sum_i f_i P_i per layer (1 when balanced)."""
  train, _ = read_metrics(workdir)
  late = train[len(train) // 2:]
  if not late or "moe_balance_loss" not in late[0]:
    return dict.fromkeys(BALANCE_COLUMNS, "")
  loads = [[r[k] for k in r if k.startswith("expert_load/")] for r in late]
  variation = statistics.mean(statistics.pstdev(shares) / statistics.mean(shares) for shares in loads)
  return dict(zip(BALANCE_COLUMNS, (f"{variation:.3f}", f"{statistics.mean(r['moe_balance_loss'] for r in late):.3f}")))


def write_tables(rows: list[dict], out: Path, name: str = "results") -> str:
  """<name>.csv and <name>.md in `out`; returns the markdown."""
  header = list(rows[0])
  with open(out / f"{name}.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=header)
    writer.writeheader()
    writer.writerows(rows)
  lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
  lines += ["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows]
  markdown = "\n".join(lines) + "\n"
  (out / f"{name}.md").write_text(markdown)
  return markdown


def is_baseline(recipe: Recipe, fields: dict) -> bool:
  """Whether a run's `fields` have every value recipe.baseline names (an empty baseline: the first cell's)."""
  wanted = recipe.baseline or {k: v for k, v in recipe.runs()[0].items() if k != recipe.seed_field}
  return all(str(fields.get(k)) == str(v) for k, v in wanted.items())


def _tokens_reached(recipe: Recipe, runs: list[dict], out: Path) -> dict:
  """Each cell's tokens to recipe.target_loss (tokens_to_target), a seed's run each: None where it is not reached."""
  reached = {}
  for fields in runs:
    workdir = out / run_name(fields)
    reached.setdefault(tuple((k, fields[k]) for k in fields if k != recipe.seed_field), []).append(
        tokens_to_target(workdir, recipe.target_loss, functools.partial(
            curriculum.summed, curriculum.phases(run_config(recipe, fields, workdir)), cost=tokens_per_step)))
  return reached


def _best_within(field: str, cells: dict) -> dict:
  """Each cell's key -> the key of the cell with the lowest mean among those whose fields differ from it in `field`
  alone (itself included)."""
  rest = lambda key: tuple((k, v) for k, v in key if k != field)
  groups = {}
  for key, values in cells.items():
    groups.setdefault(rest(key), []).append(key)
  lowest = {group: min(keys, key=lambda key: statistics.mean(cells[key])) for group, keys in groups.items()}
  return {key: lowest[rest(key)] for key in cells}


def seeded_rows(recipe: Recipe, runs: list[dict], rows: list[dict], shown: list[str], out: Path) -> list[dict]:
  """One row per cell (a run's fields but its seed) over its seeds: the final validation loss's mean (the train
  loss's where the runs are not evaluated) with its 95% confidence interval and standard deviation, and each cell
  against the baseline cell (a cumulative recipe's: the row before) seed by seed (measure/seed_stats.py): the
  difference with its interval, the paired t-test's p-value, whether it is below 0.05, and the seeds an interval of
  this spread needs to exclude 0; with recipe.target_loss, the tokens each cell takes to reach it
  (tokens_to_target) with their interval."""
  metric = "final val loss" if all(row["final val loss"] for row in rows) else "final train loss"
  cells, cell_rows = {}, {}
  for fields, row in zip(runs, rows):
    key = tuple((k, fields[k]) for k in fields if k != recipe.seed_field)
    cells.setdefault(key, []).append(float(row[metric]))
    cell_rows.setdefault(key, []).append(row)
  # The recipe's own columns, which no interval summarises, shown seed by seed.
  own = [*recipe.columns, *(BALANCE_COLUMNS if recipe.expert_balance else ())]
  base = next(key for key in cells if is_baseline(recipe, dict(key)))
  against = ("previous row" if recipe.cumulative else f"best {recipe.best_within} alike otherwise"
             if recipe.best_within else "baseline")
  best = _best_within(recipe.best_within, cells) if recipe.best_within else {}
  reached = _tokens_reached(recipe, runs, out) if recipe.target_loss else {}
  table, previous = [], None
  for key, values in cells.items():
    spread = seed_stats.cell(values)
    row = {k: _shown(v, runs, recipe.seed_field) for k, v in key if k in shown}
    row.update({"seeds": spread.n, f"{metric}, mean ± 95% CI": f"{spread.mean:.4f} ± {spread.half_width:.4f}",
                "sd": f"{spread.sd:.4f}"})
    row.update({f"{column}, each seed": " / ".join(str(r[column]) for r in cell_rows[key]) for column in own})
    # The seeds compile the same step: one figure, unless the runs' programs differ.
    row["peak MiB/device"] = " / ".join(dict.fromkeys(r["peak MiB/device"] for r in cell_rows[key]))
    if recipe.target_loss:
      tokens = [t for t in reached[key] if t is not None]
      within = seed_stats.cell(tokens) if len(tokens) == len(reached[key]) else None
      row[f"tokens to loss {recipe.target_loss} ({SMOOTHING}-log mean), mean ± 95% CI"] = (
          f"{within.mean:,.0f} ± {within.half_width:,.0f}" if within else f"{len(tokens)} of {len(reached[key])} seeds")
    compared = previous if recipe.cumulative else best.get(key, base)
    if key == compared or compared is None:
      row.update({f"vs {against}, ± 95% CI": "best" if best else "baseline", "p (paired t)": "", "p < 0.05": "",
                  "seeds to resolve": ""})
    else:
      versus = seed_stats.paired(values, cells[compared])
      row.update({f"vs {against}, ± 95% CI": f"{versus.difference:+.4f} ± {versus.half_width:.4f}",
                  "p (paired t)": f"{versus.p:.3g}", "p < 0.05": "yes" if versus.significant else "no",
                  "seeds to resolve": versus.seeds_needed or f"> {seed_stats.MAX_SEEDS}"})
    table.append(row)
    previous = key
  return table


def _axes():
  """A figure of the sweeps' size and its axes, drawn to files only (no display)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt.subplots(figsize=(6.4, 3.6), dpi=100)


def _save(figure, axes, path: Path, legend_size: int) -> None:
  import matplotlib.pyplot as plt
  axes.grid(alpha=0.3)
  axes.legend(fontsize=legend_size, frameon=False)
  figure.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path)
  plt.close(figure)


def plot(runs: list[tuple[str, Path]], title: str, path: Path) -> None:
  """Train loss as lines and validation loss as dots, one colour per run."""
  figure, axes = _axes()
  for index, (label, workdir) in enumerate(runs):
    train, evals = read_metrics(workdir)
    colour = f"C{index % 10}"
    axes.plot([r["step"] for r in train], [r["loss"] for r in train], color=colour, lw=1.2, label=label)
    axes.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o", color=colour, ms=4)
  axes.set(xlabel="step", ylabel="loss (nats/token); dots: validation", title=title)
  _save(figure, axes, path, 7)


def _over_seeds(workdirs: list[Path], validation: bool) -> tuple[list, list, list]:
  """(steps, means, 95% half-widths) of the train (or validation) loss at each step every run logged."""
  by_step = {}
  for workdir in workdirs:
    for r in read_metrics(workdir)[validation]:
      by_step.setdefault(r["step"], []).append(r["eval_loss" if validation else "loss"])
  spread = {step: seed_stats.cell(values) for step, values in sorted(by_step.items()) if len(values) == len(workdirs)}
  return list(spread), [c.mean for c in spread.values()], [c.half_width for c in spread.values()]


def plot_seeded(cells: dict[str, list[Path]], title: str, path: Path) -> None:
  """Each cell's mean train loss over its seeds' runs as a line in a band of its 95% confidence interval, step by
  step, and its validation losses' mean as dots with the interval as bars."""
  figure, axes = _axes()
  for index, (label, workdirs) in enumerate(cells.items()):
    colour = f"C{index % 10}"
    steps, means, widths = _over_seeds(workdirs, validation=False)
    axes.plot(steps, means, color=colour, lw=1.2, label=label)
    axes.fill_between(steps, [m - w for m, w in zip(means, widths)], [m + w for m, w in zip(means, widths)],
                      color=colour, alpha=0.2, lw=0)
    steps, means, widths = _over_seeds(workdirs, validation=True)
    axes.errorbar(steps, means, yerr=widths, fmt="o", color=colour, ms=4, capsize=2)
  axes.set(xlabel="step", ylabel="loss, mean ± 95% CI (dots: validation)", title=title)
  _save(figure, axes, path, 7)


def plot_versus(rows: list[dict], varied: list[str], field: str, title: str, path: Path) -> None:
  """Final validation loss against `field`, one line per setting of the other `varied` fields (log x): each point
  the mean over the seeds, with its 95% confidence interval where there are several."""
  lines = {}
  for row in rows:
    if row["final val loss"]:
      label = ", ".join(f"{k.split('.')[-1]}={row[k]}" for k in varied if k != field)
      lines.setdefault(label, {}).setdefault(float(row[field]), []).append(float(row["final val loss"]))
  figure, axes = _axes()
  for index, (label, points) in enumerate(lines.items()):
    xs = sorted(points)
    spreads = [seed_stats.cell(points[x]) if len(points[x]) > 1 else None for x in xs]
    axes.errorbar(xs, [statistics.mean(points[x]) for x in xs], fmt="o-", color=f"C{index % 10}", ms=4, lw=1.2,
                  capsize=2, label=label, yerr=[s.half_width if s else 0.0 for s in spreads])
  axes.set(xscale="log", xlabel=field, ylabel="final validation loss (nats/token)", title=title)
  _save(figure, axes, path, 6)


def _shown(value, runs: list[dict], seed_field: str, seed=None):
  """A field's table cell; a sibling run's checkpoint (`{out}/<run>:<step>`) as that run's row and the step. A
  sibling of the run's own seed (`{seed}` in its name) is the row of the run with `seed`; in a table of cells
  (`seed` None), the first seed's, each seed branching from its own."""
  if not str(value).startswith("{out}/"):
    return value
  sibling, step = str(value).removeprefix("{out}/").rsplit(":", 1)
  own_seed = "{seed}" in sibling
  sibling = sibling.replace("{seed}", str(runs[0].get(seed_field) if seed is None else seed))
  rows = [i for i, fields in enumerate(runs, 1) if run_name(fields) == sibling]
  if not rows:
    raise ValueError(f"{value!r} names no run of this recipe; `{{out}}/<run>:<step>` takes a run the recipe lists.")
  return f"row {rows[0]}" + (" (each seed its own)" if own_seed and seed is None else "") + f", step {step}"


def sweep(recipe: Recipe, out: Path, figure: Path | None = None, echo=print) -> str:
  """Run every run of `recipe` that has not finished, then write the tables and the figure."""
  out = out.resolve()  # train.py runs from the repository root
  out.mkdir(parents=True, exist_ok=True)
  runs = recipe.runs()
  varied = [k for k in runs[0] if k != recipe.seed_field or len(recipe.seeds) > 1]
  rows, curves, failed = [], [], []
  for index, fields in enumerate(runs, 1):
    name = run_name(fields)
    workdir = out / name
    marker = run_one(train_command(recipe, fields, workdir), workdir, recipe.devices)
    state = "finished earlier" if marker.get("skipped") else (
        "done" if marker["finished"] else f"FAILED (see {workdir / 'train.log'})")
    echo(f"[{index}/{len(runs)}] {name}: {state}")
    if not marker["finished"]:
      failed.append(name)
    label = ", ".join(f"{k.split('.')[-1]}={fields[k]}" for k in varied) or name
    reached = {f"steps to loss {recipe.target_loss}": steps_to(workdir, recipe.target_loss)} if recipe.target_loss else {}
    shown = {k: _shown(fields[k], runs, recipe.seed_field, fields.get(recipe.seed_field)) for k in varied}
    rows.append({**shown, **matched_steps(recipe, fields, workdir),
                 **{column: describe(fields) for column, describe in recipe.columns.items()},
                 **summarize(workdir, marker), **reached,
                 **(expert_balance(workdir) if recipe.expert_balance else {})})
    curves.append((label, workdir))
  markdown = write_tables(rows, out)
  if len(recipe.seeds) > 1 and not failed:
    cells = seeded_rows(recipe, runs, rows, [k for k in varied if k != recipe.seed_field], out)
    markdown += "\n" + write_tables(cells, out, "results_by_cell")
  if recipe.versus:
    plot_versus(rows, [k for k in varied if k != recipe.seed_field], recipe.versus, recipe.name,
                figure or out / "loss.png")
  elif len(recipe.seeds) > 1 and not failed:
    cells = {}
    for label_fields, (_, workdir) in zip(runs, curves):
      label = ", ".join(f"{k.split('.')[-1]}={label_fields[k]}" for k in varied if k != recipe.seed_field)
      cells.setdefault(label or recipe.name, []).append(workdir)
    plot_seeded(cells, recipe.name, figure or out / "loss.png")
  else:
    plot(curves, recipe.name, figure or out / "loss.png")
  if failed:
    raise RuntimeError(f"{len(failed)} run(s) failed: {', '.join(failed)}; rerun the sweep to retry them.")
  return markdown


def recipe_block(recipe: Recipe, table: str, figure: str, command: str) -> str:
  """A recipe's caption, table and figure and the command that made them, as docs/<recipe>.md and --page hold them."""
  against = ("the row before it" if recipe.cumulative else
             f"the best cell that differs from it in {recipe.best_within} alone" if recipe.best_within else
             "the baseline cell")
  seeds = (f"Each cell over {len(recipe.seeds)} runs, `{recipe.seed_field}` = {', '.join(map(str, recipe.seeds))}, "
           f"compared with {against} seed by seed (paired t-test); each run's own row is in the sweep's results.md."
           "\n\n" if len(recipe.seeds) > 1 else "")
  return (f"*`{recipe.name}`*: {recipe.question}\n\n{seeds}{table}\n![{recipe.name}]({figure})\n\n"
          f"Made by `{command}` (jax {metadata.version('jax')}, a host with {os.cpu_count()} CPU cores).\n")


def write_docs(recipe: Recipe, table: str, docs: Path, page: Path, command: str) -> None:
  """<docs>/<name>.md, and the same block between the recipe's markers in `page` (the figure is written)."""
  figure = docs / f"{recipe.name}.png"
  (docs / f"{recipe.name}.md").write_text(recipe_block(recipe, table, figure.name, command))
  link = Path(os.path.relpath(figure.resolve(), page.resolve().parent)).as_posix()
  block = recipe_block(recipe, table, link, command)
  page.write_text(replace_block(page.read_text(), f"recipe:{recipe.name}", block))


def check_runs(recipe: Recipe, out: Path) -> None:
  """Each run's settings checked as train.py checks them, before any run starts: a misspelt field or
  a bad value is one line naming the run, not a failed run an hour into the sweep. The mesh waits
  for the run itself, which sees its own devices."""
  cells = {tuple(sorted((k, str(v)) for k, v in fields.items() if k != recipe.seed_field))
           for fields in recipe.runs() if is_baseline(recipe, fields)}
  if len(cells) != 1:
    raise ValueError(f"baseline {recipe.baseline} matches {len(cells) or 'no'} cells of {recipe.name!r}; name "
                     "field=value pairs that one cell of the grid has, and only it.")
  if recipe.match:
    matched_kind(recipe.match)
    if not recipe.budget > 0:
      raise ValueError(f"match={recipe.match} with budget={recipe.budget:g}: give a budget > 0 (tokens, FLOPs or "
                       "seconds per run).")
  if recipe.best_within and recipe.best_within not in recipe.runs()[0]:
    raise ValueError(f"best_within={recipe.best_within!r} is not a field the sweep varies; name one of "
                     f"{', '.join(k for k in recipe.runs()[0] if k != recipe.seed_field)}.")
  if recipe.match and any("steps" in fields for fields in recipe.runs()):
    raise ValueError(f"match={recipe.match} sets each run's steps from the budget; leave steps out of the grid.")
  for fields in recipe.runs():
    try:
      config = run_config(recipe, fields, out / run_name(fields))  # as `sweep` gives each run its own workdir
      config = load.set_fields(config, matched_steps(recipe, fields, out / run_name(fields)))
      check_run(config)
      model_config(config)
    except ValueError as error:
      raise ValueError(f"run {run_name(fields)}: {error}") from None
