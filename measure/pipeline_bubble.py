"""Pipeline bubbles as a markdown table: both formulas beside each schedule's idle share as meshlm runs it
(parallel/schedules.py's time-lines); tools/pipeline_bubble.py prints it, docs/parallelism.md quotes it."""

from parallel import schedules


def bubble_cells(stages: int, micro: int, virtual: int) -> list[str]:
  """One table row: both formulas, each schedule's idle share as run, both formulas for V chunks."""
  cells = [str(micro), f"{schedules.bubble_over_total(stages=stages, micro=micro):.3f}",
           f"{schedules.bubble_over_ideal(stages=stages, micro=micro):.3f}"]
  for schedule, costs in schedules.SCHEDULES.items():
    if costs.stashes and micro < stages:
      cells.append("-")  # refused by parallel/checks.py: 1F1B needs at least P micro-batches
      continue
    v = virtual if costs.virtual else 1
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
