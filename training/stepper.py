"""How the loop's steps are taken: the seam every way of taking them fits (`Stepper`, `StepDone`,
`Event`), and the evaluation both steppers share.

The local stepper, which steps on the mesh as planned, is run/local_stepper.py's `LocalStepper`;
survive mode's, which outlives a lost process and takes back one started again, is
resilience/survive.py's `SurvivingStepper`; resilience/fault_tolerance.py chooses between them.
"""

import abc
import dataclasses
from typing import Callable, Iterator, Protocol

import jax
import numpy as np

from input_pipeline import data
from training.state import Layout
from training.step import evaluated


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
  eval_seconds: float = 0.0  # what that evaluation took
  data_seconds: float = 0.0  # waiting for the step's batch
  generation_seconds: float = 0.0  # sampling the step's rollouts (objective=grpo)


class Stepper(abc.ABC):
  """How the loop's steps are taken, entered around them.

  `layout` is the current one (survive mode lays the run out again), `state` the one the next step
  starts from, `peak_bytes` the compiled step's peak memory per device.
  """
  layout: Layout
  state: dict
  peak_bytes: int
  eval_metric = "eval_loss"  # what `evaluate` returns, as the metrics name it

  @abc.abstractmethod
  def steps(self) -> Iterator[StepDone]:
    """Each step from `state` on, up to config.steps."""

  @abc.abstractmethod
  def evaluate(self, done: StepDone) -> float:
    """The eval loss after step `done`."""

  def guarded(self, action: Callable[[], None]) -> bool:
    """Runs `action`, which may hold collectives between processes (a checkpoint save); False where
    it was abandoned because a process was lost during it (survive mode)."""
    action()
    return True

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    pass


def eval_loss(eval_step, layout: Layout, state, *, split, config) -> float:
  """The mean loss of `state`'s parameters over the first config.eval_batches batches of `split`."""
  losses = [eval_step(evaluated(state), data.global_batch(split, seed=data.data_seed(config), step=i, batch_size=config.batch_size,
                                                seq_len=layout.model.max_len, sharding=layout.batch_sharding))
            for i in range(config.eval_batches)]
  return float(np.mean(jax.device_get(losses)))


def eval_due(config, done: int) -> bool:
  return bool(config.eval_every) and (done % config.eval_every == 0 or done == config.steps)
