"""A curriculum: a run's first steps at smaller shapes than the config's own, each phase's step compiled ahead
(modded-nanogpt's attention-window and batch-size warmups, DeepSpeed's sequence-length warmup).

config.curriculum = "STEP:field=value[,field=value];STEP:...". An entry's fields hold from the previous entry's
STEP (or 0) up to, not including, its own STEP; from the last STEP on the run trains on the config's own fields.
Only the batch, the sequence length and the attention window vary, each at most the config's own: then one state
trains through every phase (a shorter phase keeps gpt2's learned position rows: model.positions), and the config's
own step bounds every phase's memory (the dry run's figures).
Batches stay a pure function of the step (input_pipeline/data.py), so a run resumes into the phase its step is in.
"""

import dataclasses
import functools
from typing import Callable

import ml_collections

from configs.load import override, with_fields

FIELDS = ("batch_size", "model.max_len", "model.sliding_window")
EXAMPLE = "'100:model.max_len=256,batch_size=16;200:model.sliding_window=512'"


@dataclasses.dataclass(frozen=True)
class Phase:
  end: int | None  # the first step (0-based) past the phase; None for the last, the config's own
  config: ml_collections.ConfigDict  # the run's config with the phase's fields (and no curriculum)


def phases(config) -> tuple[Phase, ...]:
  """config.curriculum's phases in order, the config's own last; a malformed entry, an unknown field or a value
  above the config's own refused in one sentence."""
  text, own = config.curriculum.strip(), with_fields(config, {"curriculum": ""})
  if not text:
    return (Phase(None, own),)
  out, previous = [], 0
  for entry in text.split(";"):
    step_text, colon, settings = entry.strip().partition(":")
    if not colon or not step_text.strip().isdigit() or "=" not in settings:
      raise ValueError(f"curriculum entry {entry!r} is not STEP:field=value[,field=value]; e.g. "
                       f"--config.curriculum={EXAMPLE}.")
    end = int(step_text)
    if end <= previous:
      raise ValueError(f"curriculum step {end} must come after {previous}: each entry names the step its phase "
                       f"ends before, in increasing order.")
    phase = own.copy_and_resolve_references()
    for setting in settings.split(","):
      field, _, value = setting.strip().partition("=")
      if field not in FIELDS:
        raise ValueError(f"curriculum field {field!r} cannot vary over a run; vary {' or '.join(FIELDS)}.")
      override(phase, field, value)
    # A shorter phase keeps the config's own learned positions (gpt2), so that its weights are the same.
    phase.model.positions = own.model.positions or own.model.max_len
    _check_below_own(phase, own, end)
    out.append(Phase(end, phase))
    previous = end
  return (*out, Phase(None, own))


def _check_below_own(phase, own, end: int) -> None:
  if not 1 <= phase.batch_size <= own.batch_size:
    raise ValueError(f"curriculum batch_size={phase.batch_size} before step {end} must be from 1 to the config's own "
                     f"batch_size={own.batch_size}, whose step bounds the run's memory.")
  if not 1 <= phase.model.max_len <= own.model.max_len:
    raise ValueError(f"curriculum model.max_len={phase.model.max_len} before step {end} must be from 1 to the "
                     f"config's own model.max_len={own.model.max_len}, the longest sequence the run trains on.")
  window, full = phase.model.sliding_window, own.model.sliding_window
  if window != full and (window < 1 or (full and window > full)):
    raise ValueError(f"curriculum model.sliding_window={window} before step {end} must be a window of 1 to "
                     f"{full or 'model.max_len'} positions, within the config's own "
                     f"(model.sliding_window={full}{', the whole context' if not full else ''}).")


def check(config) -> None:
  """Refuses a curriculum the run cannot follow, in one sentence, before anything is compiled."""
  if not config.curriculum.strip():
    return
  last = phases(config)[-2].end
  if last >= config.steps:
    raise ValueError(f"curriculum's last phase ends before step {last}, which steps={config.steps} never reaches; "
                     "end it earlier or train longer.")
  if config.objective != "lm" or config.fault_tolerance != "none":
    raise ValueError(f"curriculum={config.curriculum!r} is built for objective=lm with fault_tolerance=none, not "
                     f"objective={config.objective!r} with fault_tolerance={config.fault_tolerance!r}; leave "
                     "curriculum empty.")


def describe(run_phases: tuple[Phase, ...]) -> str:
  """One line: each phase's steps (1-based, as logged) and fields."""
  start, parts = 1, []
  for phase in run_phases:
    fields = ", ".join(f"{field} {functools.reduce(getattr, field.split('.'), phase.config)}" for field in FIELDS)
    parts.append(f"steps {start}..{phase.end} {fields}" if phase.end else f"from step {start} {fields}")
    start = (phase.end or 0) + 1
  return "curriculum: " + "; ".join(parts)


def phase_at(run_phases: tuple[Phase, ...], step: int) -> int:
  """The index of the phase that 0-based `step` trains in."""
  return next(i for i, phase in enumerate(run_phases) if phase.end is None or step < phase.end)


def summed(run_phases: tuple[Phase, ...], steps: int, cost: Callable) -> float:
  """cost(phase config) summed over steps 0 .. steps - 1: the tokens or FLOPs they spend."""
  total, start = 0.0, 0
  for phase in run_phases:
    end = steps if phase.end is None else min(phase.end, steps)
    total += max(0, end - start) * cost(phase.config)
    start = end
  return total


def steps_within(run_phases: tuple[Phase, ...], budget: float, cost: Callable) -> int:
  """The most steps whose summed cost(phase config) stays within `budget`."""
  steps, left = 0, budget
  for phase in run_phases:
    each = cost(phase.config)
    taken = int(left // each) if phase.end is None else min(phase.end - steps, int(left // each))
    steps, left = steps + taken, left - taken * each
    if phase.end is None or steps < phase.end:
      return steps
  raise AssertionError("the last phase has no end")


def tokens(phase_config) -> int:
  """Tokens one step of a phase reads."""
  return phase_config.batch_size * phase_config.model.max_len
