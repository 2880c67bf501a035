"""Print pipeline schedules as time-lines and their bubbles: both formulas beside the schedules meshlm runs.

  python tools/pipeline_bubble.py --stages 4 --micro 8 --virtual 2
  python tools/pipeline_bubble.py --stages 4 --table 1,2,4,8,16,32

The time-lines come from parallel/schedules.py, the same index arithmetic the
compiled schedules evaluate, so the idle fraction shown is that of the code.
The bubble is quoted two ways, named by what the idle time is divided by:
bubble/total, (P-1)/(M+P-1), and bubble/ideal, (P-1)/M (Megatron-LM's).
"""

import sys
from pathlib import Path

# `python tools/pipeline_bubble.py` puts tools/ on sys.path, not the repo root that holds parallel/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from absl import app, flags  # pylint: disable=wrong-import-position

from parallel import schedules  # pylint: disable=wrong-import-position

_STAGES = flags.DEFINE_integer("stages", 4, "P, pipeline stages.")
_MICRO = flags.DEFINE_integer("micro", 8, "M, micro-batches per step.")
_VIRTUAL = flags.DEFINE_integer("virtual", 2, "V, layer chunks per device for the interleaved schedule.")
_TABLE = flags.DEFINE_list("table", [], "Micro-batch counts for a bubble table instead of time-lines.")


def show_timeline(schedule: str, stages: int, micro: int, virtual: int) -> None:
  rows = schedules.timeline(schedule, stages=stages, micro=micro, virtual=virtual)
  width = max(len(cell) for row in rows for cell in row)
  print(f"\n{schedule} (P={stages}, M={micro}" + (f", V={virtual}" if schedule == "interleaved" else "")
        + f"): {len(rows[0])} ticks")
  print("tick    " + " ".join(f"{t:>{width}}" for t in range(len(rows[0]))))
  for p, row in enumerate(rows):
    print(f"stage {p} " + " ".join(f"{cell:>{width}}" for cell in row))


def bubble_cells(stages: int, micro: int, virtual: int) -> list[str]:
  """One table row: both formulas, each schedule's idle share as run, both formulas for V chunks."""
  cells = [str(micro), f"{schedules.bubble_over_total(stages=stages, micro=micro):.3f}",
           f"{schedules.bubble_over_ideal(stages=stages, micro=micro):.3f}"]
  for schedule in schedules.SCHEDULES:
    if schedule == "1f1b" and micro < stages:
      cells.append("-")  # refused by parallel/checks.py: 1F1B needs at least P micro-batches
      continue
    v = virtual if schedule == "interleaved" else 1
    cells.append(f"{schedules.idle_fraction(schedule, stages=stages, micro=micro, virtual=v):.3f}")
  cells += [f"{schedules.bubble_over_total(stages=stages, micro=micro, virtual=virtual):.3f}",
            f"{schedules.bubble_over_ideal(stages=stages, micro=micro, virtual=virtual):.3f}"]
  return cells


def bubble_table(stages: int, micros: list[int], virtual: int) -> str:
  """A markdown table; the schedules' columns are their idle share of stage-time, i.e. bubble/total."""
  header = ["M", "bubble/total (P-1)/(M+P-1)", "bubble/ideal (P-1)/M", "gpipe", "1f1b",
            f"interleaved V={virtual}", f"V={virtual}: bubble/total (P-1)/(VM+P-1)",
            f"V={virtual}: bubble/ideal (P-1)/(VM)"]
  rows = [header, ["---"] * len(header), *(bubble_cells(stages, m, virtual) for m in micros)]
  return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv):
  del argv
  stages, micro, virtual = _STAGES.value, _MICRO.value, _VIRTUAL.value
  if not _TABLE.value:
    for schedule in schedules.SCHEDULES:
      show_timeline(schedule, stages, micro, virtual if schedule == "interleaved" else 1)
    print()
  print(f"P={stages}: bubble/total and bubble/ideal divide the idle time by the total and by the ideal time;\n"
        "gpipe, 1f1b and interleaved: the share of stage-time idle as the code runs them (bubble/total)")
  print(bubble_table(stages, [int(m) for m in _TABLE.value] or [micro], virtual))


if __name__ == "__main__":
  app.run(main)
