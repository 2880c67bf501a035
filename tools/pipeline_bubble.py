"""Print pipeline schedules as time-lines and their bubbles: both formulas beside the schedules meshlm runs.

  python tools/pipeline_bubble.py --stages 4 --micro 8 --virtual 2
  python tools/pipeline_bubble.py --stages 4 --table 1,2,4,8,16,32

The time-lines come from parallel/schedules.py, the same index arithmetic the
compiled schedules evaluate, so the idle fraction shown is that of the code.
The bubble is quoted two ways, named by what the idle time is divided by:
bubble/total, (P-1)/(M+P-1), and bubble/ideal, (P-1)/M (Megatron-LM's).
"""

from absl import app, flags

from measure.pipeline_bubble import bubble_table
from parallel import schedules

_STAGES = flags.DEFINE_integer("stages", 4, "P, pipeline stages.")
_MICRO = flags.DEFINE_integer("micro", 8, "M, micro-batches per step.")
_VIRTUAL = flags.DEFINE_integer("virtual", 2, "V, layer chunks per device for the interleaved schedule.")
_TABLE = flags.DEFINE_list("table", [], "Micro-batch counts for a bubble table instead of time-lines.")


def show_timeline(schedule: str, stages: int, micro: int, virtual: int) -> None:
  rows = schedules.timeline(schedule, stages=stages, micro=micro, virtual=virtual)
  width = max(len(cell) for row in rows for cell in row)
  print(f"\n{schedule} (P={stages}, M={micro}" + (f", V={virtual}" if schedules.SCHEDULES[schedule].virtual else "")
        + f"): {len(rows[0])} ticks")
  print("tick    " + " ".join(f"{t:>{width}}" for t in range(len(rows[0]))))
  for p, row in enumerate(rows):
    print(f"stage {p} " + " ".join(f"{cell:>{width}}" for cell in row))


def main(argv):
  del argv
  stages, micro, virtual = _STAGES.value, _MICRO.value, _VIRTUAL.value
  if not _TABLE.value:
    for schedule, costs in schedules.SCHEDULES.items():
      show_timeline(schedule, stages, micro, virtual if costs.virtual else 1)
    print()
  print(f"P={stages}: bubble/total and bubble/ideal divide the idle time by the total and by the ideal time;\n"
        "gpipe, 1f1b and interleaved: the share of stage-time idle as the code runs them (bubble/total)")
  print(bubble_table(stages, [int(m) for m in _TABLE.value] or [micro], virtual))


if __name__ == "__main__":
  app.run(main)
