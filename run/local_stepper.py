"""The local stepper: steps on the mesh as planned (survive mode's stepper is resilience/survive.py's, which
resilience/fault_tolerance.py chooses instead where it protects the run)."""

import time
from typing import Iterator

import jax

from input_pipeline import data
from measure import analysis
from measure.profiling import StepProfiler, parse_steps
from training import curriculum
from training.in_flight import StepsInFlight
from training.state import Layout, plan
from training.step import compile_train_step, make_eval_step
from training.stepper import StepDone, Stepper, eval_loss


class LocalStepper(Stepper):
  """Steps on the mesh as planned: compiled ahead, batches prefetched, a bounded number of steps in
  flight, the stop vote at log steps and the profiler's window."""

  def __init__(self, config, layout: Layout, state: dict, train_split, val_split, stop):
    self.layout, self.state = layout, state
    self._config, self._train_split, self._val_split, self._stop = config, train_split, val_split, stop
    # Compiled ahead so the first interval's tokens/s leaves compilation out and the program's own
    # memory figure can be logged beside the losses; a curriculum's phases each have a step of their own.
    self._phases = curriculum.phases(config)
    weighted = train_split.mask is not None
    self._train_steps = [compile_train_step(layout if phase.end is None else plan(phase.config), phase.config,
                                            weighted=weighted) for phase in self._phases]
    self._eval_step = make_eval_step(layout)
    self.peak_bytes = max(analysis.memory_summary(step)["peak_bytes"] for step in self._train_steps)
    self._profiler = StepProfiler(parse_steps(config.profile_steps, config.steps), config.workdir)
    self._batches = None

  def __enter__(self):
    # Prefetching starts here, not when compiled: a run stopped before its first step starts none.
    config = self._config
    self._batches = data.batches(self._train_split, seed=data.data_seed(config), start=int(self.state["step"]),
                                 stop=config.steps, shape_at=self._shape_at, sharding=self.layout.batch_sharding,
                                 depth=config.data.prefetch)
    return self

  def __exit__(self, *exc_info):
    self._profiler.close()
    self._batches.close()

  def steps(self) -> Iterator[StepDone]:
    """Each step's metrics stay on device; a log step's are ready when it is yielded."""
    in_flight, log_every = StepsInFlight(), self._config.log_every
    while True:
      try:
        step, batch, figures, timing = self._next_batch()
      except StopIteration:
        return
      done = step + 1
      self._profiler.before(done)
      with self._profiler.annotate(done):
        self.state, pending = self._train_steps[curriculum.phase_at(self._phases, step)](self.state, batch)
      in_flight.add(pending["loss"])
      self._profiler.after(done, self.state)
      if done % log_every == 0:  # the step's collectives finish before the stop vote's begin
        jax.block_until_ready(pending)
      yield StepDone(done, self.state, {**pending, **figures}, stop=self._stop.requested(done, log_every), **timing)

  def _shape_at(self, step: int) -> tuple[int, int]:
    """(sequences, positions) of step `step`'s batch: its phase's."""
    phase = self._phases[curriculum.phase_at(self._phases, step)].config
    return phase.batch_size, phase.model.max_len

  def _next_batch(self) -> tuple:
    """(step, batch, figures the step's metrics carry, StepDone's timing fields) of the next step."""
    asked = time.perf_counter()
    step, batch = next(self._batches)
    return step, batch, {}, {"data_seconds": time.perf_counter() - asked}  # the prefetcher was behind

  def evaluate(self, done: StepDone) -> float:
    return eval_loss(self._eval_step, self.layout, done.state, split=self._val_split,
                     config=self._config)
