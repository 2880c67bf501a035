"""Print pipeline schedules as time-lines and their bubbles: the textbook formula beside the schedule meshlm runs.

  python tools/pipeline_bubble.py --stages 4 --micro 8 --virtual 2
  python tools/pipeline_bubble.py --stages 4 --table 1,2,4,8,16,32

The time-lines come from parallel/schedules.py, the same index arithmetic the
compiled schedules evaluate, so the idle fraction shown is that of the code.
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


def bubble_row(stages: int, micro: int, virtual: int) -> str:
  cells = [f"{micro:>4}", f"{schedules.textbook_bubble(stages=stages, micro=micro):9.3f}"]
  for schedule in schedules.SCHEDULES:
    v = virtual if schedule == "interleaved" else 1
    if schedule == "1f1b" and micro < stages:
      cells.append(f"{'-':>12}")
      continue
    cells.append(f"{schedules.idle_fraction(schedule, stages=stages, micro=micro, virtual=v):12.3f}")
  cells.append(f"{schedules.textbook_bubble(stages=stages, micro=micro, virtual=virtual):15.3f}")
  return " ".join(cells)


def main(argv):
  del argv
  stages, micro, virtual = _STAGES.value, _MICRO.value, _VIRTUAL.value
  if _TABLE.value:
    print(f"P={stages}, V={virtual}: idle fraction of each schedule as run, beside (P-1)/(M+P-1)")
    print("   M  textbook        gpipe         1f1b  interleaved  textbook / V")
    for m in _TABLE.value:
      print(bubble_row(stages, int(m), virtual))
    return
  for schedule in schedules.SCHEDULES:
    show_timeline(schedule, stages, micro, virtual if schedule == "interleaved" else 1)
  print("\n" + "   M  textbook        gpipe         1f1b  interleaved  textbook / V")
  print(bubble_row(stages, micro, virtual))


if __name__ == "__main__":
  app.run(main)
