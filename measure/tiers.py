"""Which network tier a collective's bytes cross: inside a slice or host (fast), or between them (slow).

A collective over D = a x b devices, a inside each of b slow-tier groups, runs
hierarchically, as NCCL and XLA's multi-slice collectives do: an all-reduce
reduce-scatters inside each group (the fast links carry (a-1)/a of the buffer),
all-reduces the 1/a left across the groups (the slow tier carries (b-1)/b of
that, twice) and all-gathers inside again. Its ring bytes 2N(ab-1)/(ab) split
into 2N(a-1)/a fast and 2N(b-1)/(ab) slow, so the slow tier's share is
(b-1)/(ab-1); the same holds for all-gather and reduce-scatter. An all-to-all
sends 1/D of its buffer to each other member, and the a(b-1) of them in other
groups take their share across: a(b-1)/(ab-1). A collective-permute's share is
the fraction of its source-target pairs whose ends lie in different groups.
"""

import math
from fractions import Fraction

from parallel.mesh import AXES, PIPELINE
from parallel.schedules import SCHEDULES

FAST, SLOW = "fast", "slow"


def slow_share(kind: str, inside: int, groups: int, crossing_pairs: Fraction | None = None) -> Fraction:
  """The fraction of a collective's ring bytes that cross the slow tier; `inside` x `groups` devices."""
  if kind == "collective-permute":
    return crossing_pairs if crossing_pairs is not None else Fraction(0)
  members = inside * groups
  if groups == 1 or members == 1:
    return Fraction(0)
  if kind == "all-to-all":
    return Fraction(inside * (groups - 1), members - 1)
  return Fraction(groups - 1, members - 1)


def pipeline_crossing_pairs(stages: int, groups: int, schedule: str) -> Fraction:
  """The share of a pipeline hand-off's pairs that cross the slow tier, stages in order over `groups`:
  a ring (gpipe, interleaved: the last stage hands back to the first) crosses at each of the `groups`
  boundaries, 1F1B's chain (no pair from the last to the first) at the groups - 1 inside it."""
  if groups == 1:
    return Fraction(0)
  if not SCHEDULES[schedule].ring:
    return Fraction(groups - 1, stages - 1)
  return Fraction(groups, stages)


def split(traffic: dict[tuple[str, str], int], mesh: dict[str, int], slow: dict[str, int],
          schedule: str = "gpipe") -> dict[tuple[str, str], dict[str, int]]:
  """Estimated ring bytes by (kind, axes) split into {"fast": ..., "slow": ...}; `slow` is
  parallel.mesh.slow_tier_shape's groups per axis, `schedule` the pipeline's (for its hand-offs)."""
  out = {}
  for (kind, axes_key), sent in traffic.items():
    axes = [a for a in AXES if a in axes_key.split("+")]
    groups = math.prod(slow.get(a, 1) for a in axes)
    inside = math.prod(mesh[a] for a in axes) // groups
    pairs = (pipeline_crossing_pairs(mesh[PIPELINE], slow.get(PIPELINE, 1), schedule)
             if axes == [PIPELINE] else None)
    crossing = int(sent * slow_share(kind, inside, groups, pairs))
    out[(kind, axes_key)] = {FAST: sent - crossing, SLOW: crossing}
  return out
