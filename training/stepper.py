"""How the loop's steps are taken: the seam every way of taking them fits (`Stepper`, `StepDone`,
`Event`), and the local stepper, which steps on the mesh as planned.

Survive mode's stepper, which outlives a lost process and takes back one started again, is
training/survive.py's `SurvivingStepper`.
"""

import abc
import dataclasses
from typing import Iterator, Protocol

import jax
import numpy as np

from parallel import analysis
from training import data
from training.dry_run import compile_train_step
from training.in_flight import StepsInFlight
from training.profiling import StepProfiler, parse_steps
from training.state import Layout
from training.step import make_eval_step


class Event(Protocol):
  """Something that befell the run's processes before a step: its metrics record and its log line."""

  def record(self) -> dict: ...

  def line(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class StepDone:
  """A step done, as the training loop receives it."""
  step: int  # 1-based, as logged
  state: dict
  metrics: dict  # on device
  stop: bool = False  # the processes agreed to stop here (a signal)
  events: tuple[Event, ...] = ()  # what changed the run's processes since the last step, oldest first
  eval_loss: float | None = None  # where the stepper evaluates with the step (survive mode)


class Stepper(abc.ABC):
  """How the loop's steps are taken, entered around them.

  `layout` is the current one (survive mode lays the run out again), `state` the one the next step
  starts from, `peak_bytes` the compiled step's peak memory per device.
  """
  layout: Layout
  state: dict
  peak_bytes: int

  @abc.abstractmethod
  def steps(self) -> Iterator[StepDone]:
    """Each step from `state` on, up to config.steps."""

  @abc.abstractmethod
  def evaluate(self, done: StepDone) -> float:
    """The eval loss after step `done`."""

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    pass


class LocalStepper(Stepper):
  """Steps on the mesh as planned: compiled ahead, batches prefetched, a bounded number of steps in
  flight, the stop vote at log steps and the profiler's window."""

  def __init__(self, config, layout: Layout, state: dict, train_split, val_split, stop):
    self.layout, self.state = layout, state
    self._config, self._train_split, self._val_split, self._stop = config, train_split, val_split, stop
    # Compiled ahead so the first interval's tokens/s leaves compilation out and the program's own
    # memory figure can be logged beside the losses.
    self._train_step = compile_train_step(layout, config)
    self._eval_step = make_eval_step(layout)
    self.peak_bytes = analysis.memory_summary(self._train_step)["peak_bytes"]
    self._profiler = StepProfiler(parse_steps(config.profile_steps, config.steps), config.workdir)
    self._batches = None

  def __enter__(self):
    # Prefetching starts here, not when compiled: a run stopped before its first step starts none.
    config = self._config
    self._batches = data.batches(self._train_split, seed=config.seed, start=int(self.state["step"]),
                                 stop=config.steps, batch_size=config.batch_size,
                                 seq_len=self.layout.model.max_len, sharding=self.layout.batch_sharding,
                                 depth=config.data.prefetch)
    return self

  def __exit__(self, *exc_info):
    self._profiler.close()
    self._batches.close()

  def steps(self) -> Iterator[StepDone]:
    """Each step's metrics stay on device; a log step's are ready when it is yielded."""
    in_flight, log_every = StepsInFlight(), self._config.log_every
    for step, batch in self._batches:
      done = step + 1
      self._profiler.before(done)
      with self._profiler.annotate(done):
        self.state, pending = self._train_step(self.state, batch)
      in_flight.add(pending["loss"])
      self._profiler.after(done, self.state)
      if done % log_every == 0:  # the step's collectives finish before the stop vote's begin
        jax.block_until_ready(pending)
      yield StepDone(done, self.state, pending, stop=self._stop.requested(done, log_every))

  def evaluate(self, done: StepDone) -> float:
    return eval_loss(self._eval_step, self.layout, done.state["params"], split=self._val_split,
                     config=self._config)


def eval_loss(eval_step, layout: Layout, params, *, split, config) -> float:
  """The mean loss of `params` over the first config.eval_batches batches of `split`."""
  losses = [eval_step(params, data.global_batch(split, seed=config.seed, step=i, batch_size=config.batch_size,
                                                seq_len=layout.model.max_len, sharding=layout.batch_sharding))
            for i in range(config.eval_batches)]
  return float(np.mean(jax.device_get(losses)))


def eval_due(config, done: int) -> bool:
  return bool(config.eval_every) and (done % config.eval_every == 0 or done == config.steps)
