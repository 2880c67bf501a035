"""Which micro-batch each pipeline stage works on at each tick: the index arithmetic of every schedule.

Pure integer arithmetic that runs on numpy ints (for the timeline tool and the
bubble figures) and on traced jax ints (inside the compiled schedules), so the
tables printed are the schedule the code runs.

- gpipe / interleaved (a circular pipeline): micro-batches enter stage 0 in
  groups of P; micro-batch m = gP + k is at virtual stage s (0 <= s < PV, on
  device s mod P) at tick gPV + k + s. No device ever holds two at once, and
  the whole run takes MV + P - 1 ticks when P divides M. GPipe is V = 1.
- 1f1b: every tick each stage has one forward slot and one backward slot:
  forward of micro-batch t - p and backward of micro-batch t - (2P - 2 - p), so
  the last stage turns each micro-batch round at once and stage p keeps at
  most 2(P - 1 - p) + 1 micro-batches waiting for their backward pass. Forwards run
  on ticks 0 .. M+P-2 and backwards on ticks P-1 .. M+2P-3, so the run lasts
  (M + P - 1) forward and (M + P - 1) backward slot-times: GPipe's bubble.

SCHEDULES holds each schedule's costs (parallel/costs.py's terms), which
measure/ composes; parallel/pipeline.py runs them.
"""

import dataclasses
import functools
from typing import Callable

from parallel.costs import gather
from parallel.mesh import PIPELINE


@dataclasses.dataclass(frozen=True)
class Schedule:
  """What a pipeline schedule costs on `stages` stages running `micro` micro-batches (`virtual` chunks each)."""
  ticks: Callable[..., int]  # (stages=, micro=, virtual=): ticks of its stage loop
  held: Callable[..., int]  # (stages=, micro=, virtual=): micro-batches whose residuals a stage holds at once
  # (hop: bytes of one micro-batch's activations, stages=, micro=, virtual=): {(kind, axis): bytes one device
  # sends per accumulated micro-batch}, the stage hand-offs and the head's rows
  sent: Callable[..., dict[tuple[str, str], int]]
  # Each micro-batch's residuals wait in a stash between its forward and backward slots, and its head runs
  # as it leaves the last stage (1f1b); otherwise autodiff through the tick loop keeps every tick's.
  stashes: bool = False
  virtual: bool = False  # reads pipeline.virtual_stages (interleaved); the others run one chunk per stage
  # The last stage hands back to the first (a circular pipeline), so hand-offs form a ring, not a chain.
  ring: bool = True


def micro_batches(config, stages: int) -> int:
  """How many micro-batches one step runs forward: grad_accum of them, each split again into the
  pipeline's micro-batches when the mesh has stages."""
  return config.grad_accum * (config.pipeline.microbatches if stages > 1 else 1)


def virtual_stages(pipeline) -> int:
  """The chunks each stage runs under `pipeline` (config.pipeline): virtual_stages where the schedule reads it."""
  return pipeline.virtual_stages if SCHEDULES[pipeline.schedule].virtual else 1


def circular_slot(tick, stage, *, stages: int, virtual: int, micro: int):
  """(micro-batch, virtual stage, valid) at (tick, stage) of the circular pipeline."""
  k = (tick - stage) % stages
  entered = tick - k
  group, virtual_stage = entered // (stages * virtual), entered % (stages * virtual)
  m = group * stages + k
  return m, virtual_stage, (entered >= 0) & (m < micro)


def circular_ticks(*, stages: int, virtual: int, micro: int) -> int:
  return circular_output_tick(micro - 1, stages=stages, virtual=virtual) + 1


def circular_output_tick(m, *, stages: int, virtual: int):
  """The tick at which micro-batch m leaves the last virtual stage."""
  return (m // stages) * stages * virtual + m % stages + stages * virtual - 1


def one_f_one_b_slots(tick, stage, *, stages: int, micro: int):
  """(forward micro-batch, its validity, backward micro-batch, its validity) at (tick, stage)."""
  forward = tick - stage
  backward = tick - (2 * stages - 2 - stage)
  return forward, (forward >= 0) & (forward < micro), backward, (backward >= 0) & (backward < micro)


def one_f_one_b_ticks(*, stages: int, micro: int) -> int:
  return micro + 2 * stages - 2


def stash_slots(*, stages: int, micro: int) -> int:
  """Micro-batches stage 0 holds between their forward and backward slots: 2P - 1, or M if fewer."""
  return min(2 * stages - 1, micro)


def timeline(schedule: str, *, stages: int, micro: int, virtual: int = 1) -> list[list[str]]:
  """One row per stage, one cell per tick: 'F3' forward of micro-batch 3, 'B3' backward, '.' idle.

  For the circular schedules the backward pass mirrors the forward one (autodiff),
  so only the forward ticks are shown; a cell 'F3.1' is micro-batch 3 in chunk 1.
  """
  rows = []
  for p in range(stages):
    row = []
    if schedule == "1f1b":
      for t in range(one_f_one_b_ticks(stages=stages, micro=micro)):
        f, f_ok, b, b_ok = one_f_one_b_slots(t, p, stages=stages, micro=micro)
        row.append("/".join(x for x in (f"F{f}" if f_ok else "", f"B{b}" if b_ok else "") if x) or ".")
    else:
      for t in range(circular_ticks(stages=stages, virtual=virtual, micro=micro)):
        m, s, ok = circular_slot(t, p, stages=stages, virtual=virtual, micro=micro)
        row.append((f"F{m}" + (f".{s // stages}" if virtual > 1 else "")) if ok else ".")
    rows.append(row)
  return rows


@functools.cache  # pure, and the layout planner asks the same ones thousands of times
def busy_slots(schedule: str, *, stages: int, micro: int, virtual: int = 1) -> dict[int, int]:
  """{the schedule's ticks: the ticks a stage's slot is busy}, the same for each slot and stage.

  Every slot runs under lax.cond, so of its loop's ticks a slot does work on
  these alone: the reading of a compiled pipeline (measure/analysis.py `busy`).
  """
  rows = timeline(schedule, stages=stages, micro=micro, virtual=virtual)
  busy = {sum("F" in cell for cell in row) for row in rows}
  assert len(busy) == 1, f"stages of {schedule} differ in busy ticks: {busy}"
  return {len(rows[0]): busy.pop()}


def idle_fraction(schedule: str, *, stages: int, micro: int, virtual: int = 1) -> float:
  """The share of stage-time the schedule leaves idle: its bubble, as the code runs it.

  Stages move in lockstep: a tick lasts as long as the busiest stage's slots
  in it (idle slots are skipped with lax.cond), counting every slot as equal.
  """
  slots = lambda cell: 0 if cell == "." else len(cell.split("/"))
  columns = list(zip(*timeline(schedule, stages=stages, micro=micro, virtual=virtual)))
  busy = sum(slots(cell) for column in columns for cell in column)
  duration = sum(max(slots(cell) for cell in column) for column in columns)
  return 1 - busy / (stages * duration)


def bubble_over_total(*, stages: int, micro: int, virtual: int = 1) -> float:
  """Idle over total stage-time, (P - 1) / (VM + P - 1): each schedule's idle_fraction (interleaved: P | M)."""
  return (stages - 1) / (virtual * micro + stages - 1)


def bubble_over_ideal(*, stages: int, micro: int, virtual: int = 1) -> float:
  """Idle time over the ideal (all-busy) time, (P - 1) / (VM): Megatron-LM's bubble fraction.

  Narayanan et al. (2021) divide the idle time by the ideal time, not by the
  total, so their figure is above bubble_over_total's: 3/32 against 3/35 at P=4, M=32.
  """
  return (stages - 1) / (virtual * micro)


def _circular_sent(hop: int, *, stages: int, micro: int, virtual: int) -> dict:
  """One permute per tick forward and its transpose backward; an all-to-all scatters the last stage's
  outputs over the stages for the head, and its transpose brings their gradients back."""
  return {("all-to-all", PIPELINE): 2 * gather(micro * hop, stages),
          ("collective-permute", PIPELINE): 2 * circular_ticks(stages=stages, virtual=virtual, micro=micro) * hop}


def _one_f_one_b_sent(hop: int, *, stages: int, micro: int, virtual: int) -> dict:
  """A forward and a backward permute per tick, and per tick the all-to-all that shares the finished
  micro-batch's head over the stages, and its transpose."""
  del virtual
  ticks = one_f_one_b_ticks(stages=stages, micro=micro)
  return {("all-to-all", PIPELINE): 2 * ticks * gather(hop, stages), ("collective-permute", PIPELINE): 2 * ticks * hop}


def _circular_ticks(*, stages: int, micro: int, virtual: int) -> int:
  return circular_ticks(stages=stages, virtual=virtual, micro=micro)


SCHEDULES = {
    "gpipe": Schedule(ticks=_circular_ticks, held=_circular_ticks, sent=_circular_sent),
    "1f1b": Schedule(ticks=lambda *, stages, micro, virtual: one_f_one_b_ticks(stages=stages, micro=micro),
                     held=lambda *, stages, micro, virtual: stash_slots(stages=stages, micro=micro),
                     sent=_one_f_one_b_sent, stashes=True, ring=False),
    "interleaved": Schedule(ticks=_circular_ticks, held=_circular_ticks, sent=_circular_sent, virtual=True),
}
