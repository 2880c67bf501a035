"""docs/planning.md's "Plan a cluster from a laptop" tables: GPT-2 1.5B dry runs on 64 simulated devices, one command.

  python tools/scale_table.py                       # every row; prints both tables
  python tools/scale_table.py --rows=zero0,tp8      # a subset
  python tools/scale_table.py --write               # and rewrite docs/planning.md's <!-- scale:rows --> and <!-- scale:bar -->

Each row is one `train.py --dry_run --simulate_devices=64` subprocess (a
mesh fixes the device count when jax starts), read back from what it prints:
estimate / compiled per device for memory, collective bytes (compiled: the
program as partitioned, before the CPU backend's passes) and FLOPs (compiled:
the partitioned program's dots, loops times their trips). The first table
holds each row; the second the issue-16 bar: compiled / estimate bytes,
compiled / ideal FLOPs, and the pipeline figures.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

from measure.doc_blocks import replace_block
from measure.dry_run import COMPILED_FLOPS, IDEAL

ROOT = Path(__file__).resolve().parent.parent

GiB, MiB = 2**30, 2**20
BASE = ["--config=configs/gpt2.py:1558m", "--dry_run", "--simulate_devices=64", "--config.batch_size=64"]
HEADS32 = "--config.model.num_heads=32"  # 25 heads do not split over tensor=8; 32 keep the parameter count
ROWS = {  # name -> (what docs/planning.md calls the row, its flags beside BASE)
    "zero0": ("data=64, zero=0", ["--config.mesh.data=64"]),
    "zero3": ("data=64, zero=3", ["--config.mesh.data=64", "--config.sharding.zero=3"]),
    "tp8": ("data=8 x tensor=8 (32 heads)", ["--config.mesh.data=8", "--config.mesh.tensor=8", HEADS32]),
    "gpipe": ("pipeline=4 x data=16, gpipe, M=4",
              ["--config.mesh.pipeline=4", "--config.mesh.data=16", "--config.pipeline.schedule=gpipe"]),
    "1f1b": ("pipeline=4 x data=16, 1f1b, M=4",
             ["--config.mesh.pipeline=4", "--config.mesh.data=16", "--config.pipeline.schedule=1f1b"]),
    "tp8pp8": ("tensor=8 x pipeline=8, M=8 (32 heads)",
               ["--config.mesh.tensor=8", "--config.mesh.pipeline=8", "--config.pipeline.microbatches=8",
                HEADS32]),
    "seq4": ("data=16 x sequence=4", ["--config.mesh.data=16", "--config.mesh.sequence=4"]),
    # Llama 3 405B's long-context layout in small: tensor x context x pipeline x data. The ring: inside a stage
    # GSPMD gathers the heads over tensor around an all-gather (parallel/context.py in_map), not round a ring.
    "4d": ("tensor=4 x sequence=4 ring x pipeline=2 x data=2, 1f1b, M=8 (32 heads)",
           ["--config.mesh.tensor=4", "--config.mesh.sequence=4", "--config.mesh.pipeline=2", "--config.mesh.data=2",
            "--config.attention.context=ring", "--config.pipeline.schedule=1f1b", "--config.pipeline.microbatches=8",
            HEADS32]),
}

_ROWS = flags.DEFINE_list("rows", list(ROWS), f"Rows to run, of {', '.join(ROWS)}.")
_WRITE = flags.DEFINE_bool("write", False, "Rewrite the tables between the <!-- scale:... --> markers of --page.")
_PAGE = flags.DEFINE_string("page", str(ROOT / "docs" / "planning.md"), "The file --write rewrites.")

# A line of the dry run's comparison: what, estimate MiB, then compiled MiB, ratio and CPU backend MiB where given.
_BYTES_LINE = re.compile(r"^(memory: \w+ \(.*?\)|[\w-]+ over [\w+-]+|collectives: total)\s+(-?[\d.]+)\s*(-?[\d.]+)?")
_FLOPS_LINE = re.compile(r"^(estimate: total|ideal: .*?|compiled: .*?)\s+([\d.]+)$")


def command(name: str) -> list[str]:
  return [sys.executable, str(ROOT / "train.py"), *BASE, *ROWS[name][1]]


def run_row(name: str) -> dict:
  """One dry run: {label: (estimate MiB, compiled MiB or None)} for bytes, {label: GFLOP} for FLOPs, and seconds."""
  started = time.perf_counter()
  done = subprocess.run(command(name), cwd=ROOT, capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"row {name} failed ({' '.join(command(name)[1:])}):\n{done.stderr[-3000:]}")
  sizes, flops = {}, {}
  for line in done.stdout.splitlines():
    if match := _BYTES_LINE.match(line):
      sizes[match.group(1)] = (float(match.group(2)), float(match.group(3)) if match.group(3) else None)
    elif match := _FLOPS_LINE.match(line):
      flops[match.group(1)] = float(match.group(2))
  if "collectives: total" not in sizes or COMPILED_FLOPS not in flops:
    raise RuntimeError(f"row {name}: the dry run printed no comparison:\n{done.stdout[-3000:]}")
  return {"sizes": sizes, "flops": flops, "seconds": time.perf_counter() - started}


def _gib(pair) -> str:
  return f"{pair[0] * MiB / GiB:.1f} / {pair[1] * MiB / GiB:.1f}"


def rows_table(results: dict) -> str:
  lines = ["| mesh (64 devices) | params + opt state + batch GiB | temporaries GiB | collectives GiB/step "
           "| by kind and axes, GiB | FLOPs/device TFLOP | dry run s |", "| --- | --- | --- | --- | --- | --- | --- |"]
  for name, r in results.items():
    sizes, flops = r["sizes"], r["flops"]
    kinds = "; ".join(f"{what.replace(' over ', ' ')} {guess * MiB / GiB:.2f} / {got * MiB / GiB:.2f}"
                      for what, (guess, got) in sizes.items() if " over " in what and (guess or got))
    lines.append(f"| {ROWS[name][0]} | {_gib(sizes['memory: arguments (params + opt_state + batch)'])} "
                 f"| {_gib(sizes['memory: temporaries (grads + activations)'])} "
                 f"| {_gib(sizes['collectives: total'])} | {kinds} "
                 f"| {flops['estimate: total'] / 1e3:.1f} / {flops[COMPILED_FLOPS] / 1e3:.1f} | {r['seconds']:.0f} |")
  return "\n".join(lines) + "\n"


def bar_table(results: dict) -> str:
  """The issue's bar, from the rows run: each measure, what the compiled program gives, and the goal."""
  lines = ["| measure | compiled | goal |", "| --- | --- | --- |"]
  for name, r in results.items():
    guess, got = r["sizes"]["collectives: total"]
    lines.append(f"| collective bytes, compiled / estimate, {ROWS[name][0]} | {got / guess:.2f}x | <= 1.10x |")
  if "tp8" in results:
    _, got = results["tp8"]["sizes"].get("all-reduce over tensor", (0, 0))
    lines.append(f"| tensor all-reduce bytes, {ROWS['tp8'][0]} | {got * MiB / GiB:.2f} GiB | <= 8.4 GiB |")
  for name, r in results.items():
    flops = r["flops"]
    lines.append(f"| FLOPs per device, compiled / ideal, {ROWS[name][0]} "
                 f"| {flops[COMPILED_FLOPS] / flops[IDEAL]:.2f}x | <= 1.05x |")
  if "gpipe" in results and "1f1b" in results:
    ratio = results["1f1b"]["flops"][COMPILED_FLOPS] / results["gpipe"]["flops"][COMPILED_FLOPS]
    lines.append(f"| FLOPs per device, 1F1B / GPipe (compiled) | {ratio:.2f}x | <= 1.05x |")
  if "1f1b" in results:
    temporaries = results["1f1b"]["sizes"]["memory: temporaries (grads + activations)"]
    lines.append(f"| temporaries, {ROWS['1f1b'][0]}, estimate / compiled | {_gib(temporaries)} GiB "
                 "| no higher than 10.2 / 11.7 GiB |")
  return "\n".join(lines) + "\n"


def made_by() -> str:
  rows = "" if _ROWS.value == list(ROWS) else f" --rows={','.join(_ROWS.value)}"
  return f"\nMade by `python tools/scale_table.py{rows} --write`.\n"


def main(argv):
  del argv
  unknown = [name for name in _ROWS.value if name not in ROWS]
  if unknown:
    sys.exit(f"error: --rows names {', '.join(unknown)}, not rows of {', '.join(ROWS)}.")
  page = Path(_PAGE.value)
  try:
    if _WRITE.value:  # refuse missing markers before minutes of dry runs, not after
      replace_block(replace_block(page.read_text(), "scale:rows", ""), "scale:bar", "")
    results = {}
    for name in _ROWS.value:
      print(f"{name}: {' '.join(command(name)[1:])}", flush=True)
      results[name] = run_row(name)
  except (ValueError, RuntimeError) as error:
    sys.exit(f"error: {error}")
  rows, bar = rows_table(results), bar_table(results)
  print(rows + "\n" + bar, end="")
  if _WRITE.value:
    text = replace_block(page.read_text(), "scale:rows", rows + made_by())
    page.write_text(replace_block(text, "scale:bar", bar + made_by()))
    print(f"wrote the scale:rows and scale:bar blocks of {page}")


if __name__ == "__main__":
  app.run(main)
