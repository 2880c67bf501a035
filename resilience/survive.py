"""Checkpointless training: when a process dies, the live ones redo the step without it (fault_tolerance=survive).

Each step runs inside `jax.live_devices` (JAX's fault-tolerant multi-controller mode): the block
either succeeds on every live process or raises on every one. When a process is lost, the others
shrink `data` to the devices left, rebuild each state leaf from the copies they hold, with nothing
read from disk (data parallelism keeps a full copy per replica, so nothing is sent between
processes; hybrid sharding regroups into groups that divide the live devices and sends each shard
from a live copy: resilience/state_transfer.py), and redo the failed step at the same global batch:
batch `s` is a pure function of (seed, s), so the lost replica's rows are simply spread over the
survivors, with more gradient accumulation where a device would otherwise hold more rows than
before. A process started again later joins at a step boundary: the mesh grows back and the state
comes from a live replica (resilience/rejoin.py).
"""

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Iterator

import jax
from jax._src import distributed as jax_distributed
from jax.experimental.multihost_utils import ProcessFailureError, live_devices
from ml_collections import ConfigDict

from input_pipeline import data
from measure import analysis
from parallel.mesh import AXES, DATA, EXPERT, PIPELINE
from resilience.redundancy import survival_problem
from resilience.state_transfer import relocate, share_state
from resilience.survive_events import Interruptions
from training.state import Layout, abstract_inputs, plan
from training.step import make_eval_step, make_train_step
from training.stepper import StepDone, Stepper, eval_due, eval_loss


def shrunk_config(config, mesh_shape: dict, live_count: int):
  """`config` for `live_count` devices: fewer data-parallel replicas, the same global batch.

  Under hybrid sharding (sharding.fsdp_group=G) the batch splits over the data devices of every
  group, and the groups become the largest that divide both G and the data devices left: each
  device then holds G/group times its former share of the sharded state.
  Returns (config, None), or (None, why not) in one sentence.
  """
  group = config.sharding.fsdp_group
  batch_axes = (DATA, EXPERT) if group else (DATA,)  # hybrid sharding runs its groups on `expert`
  others = math.prod(size for axis, size in mesh_shape.items() if axis not in batch_axes)
  if live_count % others:
    return None, (f"{live_count} live devices do not divide into the other mesh axes "
                  f"({others} devices per data-parallel replica)")
  replicas = live_count // others
  shards = replicas if group else replicas * mesh_shape[EXPERT]  # the batch splits over data and expert
  pipeline_micro = config.pipeline.microbatches if mesh_shape[PIPELINE] > 1 else 1
  before = config.batch_size // (config.grad_accum * pipeline_micro * mesh_shape[DATA] * mesh_shape[EXPERT])
  # The fewest micro-batches (a multiple of today's) that keep each device's rows within what it held.
  for grad_accum in range(config.grad_accum, config.batch_size + 1, config.grad_accum):
    rows, left = divmod(config.batch_size, grad_accum * pipeline_micro * shards)
    if not left and rows <= before:
      smaller = config.copy_and_resolve_references()
      for axis in AXES:
        smaller.mesh[axis] = replicas if axis == DATA else 1 if group and axis == EXPERT else mesh_shape[axis]
      if group:
        smaller.sharding.fsdp_group = math.gcd(group, replicas)
      smaller.grad_accum = grad_accum
      return smaller, None
  return None, (f"batch_size={config.batch_size} does not split evenly over {replicas} data-parallel "
                f"replicas with at most {before} rows per device")


@dataclasses.dataclass(frozen=True)
class LaidOut:
  """The run over one set of live devices: its layout, the config it runs there, its compiled steps."""
  layout: Layout
  config: ConfigDict  # the run's own, or shrunk to fit the live devices
  train_step: Callable | None  # None on a process joining, until it is laid out with the live ones
  eval_step: Callable | None  # None without evaluation


@dataclasses.dataclass(frozen=True)
class _Stepped:
  """A block that ran a step."""
  state: dict
  metrics: dict
  stop: bool
  eval_loss: float | None


@dataclasses.dataclass(frozen=True)
class _Relaid:
  """A block that laid the run out again over the live devices and moved the state there."""
  laid_out: LaidOut
  state: dict
  came_back: tuple[int, ...] | None  # the processes back, where the mesh grew; None where it shrank


class Survivor:
  """Train steps that outlive lost processes; `steps()` yields each one done."""

  def __init__(self, config, layout: Layout, split, evaluate, eval_due, compile_steps=None, joining=False):
    """`joining`: this process was started again into a run in progress; `rejoin` is its first call."""
    self._split = split
    self._evaluate, self._eval_due = evaluate, eval_due  # evaluate(eval_step, layout, params) -> loss
    self._compile_steps = compile_steps or compiled_steps  # (layout, config) -> (train step, eval step)
    self._all_devices = list(layout.mesh.devices.flat)
    self._first = config, dict(layout.mesh.shape)  # what a mesh grown back to every device runs
    train_step, eval_step = (None, None) if joining else self._compile_steps(layout, config)
    self._laid_out = LaidOut(layout, config, train_step, eval_step)

  @property
  def layout(self) -> Layout:
    return self._laid_out.layout

  @property
  def config(self):
    return self._laid_out.config

  @property
  def compiled(self):
    return self._laid_out.train_step

  def rejoin(self, abstract_state) -> tuple[dict, Interruptions]:
    """On a process started again: the run's state on the grown mesh, sent from a live replica, and
    what its first step tells (that this process rejoined).

    Waits in the live processes' next step boundary, where they see more live devices than their
    mesh and grow it (`steps`): the same block, the same layout and the same transfer on both sides.
    """
    while True:
      began = time.perf_counter()
      try:
        with live_devices(self._all_devices) as live:
          laid_out = self._relayout(live, grow=True)
          state = jax.block_until_ready(share_state(abstract_state, laid_out.layout, holders=()))
      except ProcessFailureError:
        continue  # a process lost during the transfer: the live ones lay out again, and so does this one
      self._laid_out = laid_out
      return state, Interruptions(rejoined=(jax.process_index(),), rejoin_seconds=time.perf_counter() - began)

  def steps(self, state, start: int, stop, interruptions: Interruptions = Interruptions()) -> Iterator[StepDone]:
    """Yields each step done up to config.steps, with what befell the processes since the one before.

    `interruptions`: what the first step tells besides its own (a rejoin's, from `rejoin`). The
    processes vote on a stop request, and evaluate when it is due, inside the same block as the step:
    a process lost during either fails the block, like one lost during the step.
    """
    step = start
    while step < self.config.steps:
      began = time.perf_counter()
      try:
        with live_devices(self._all_devices) as live:
          # Relaid out in a block of its own: its closing barrier lines the processes up again
          # before the next step's collectives, whatever each spent compiling.
          outcome = (self._step(state, step, stop, live) if set(live) == set(self.layout.mesh.devices.flat)
                     else self._shrink_or_grow(state, step, live))
      except ProcessFailureError:
        interruptions = interruptions.failed(began, processes_of(self.layout))
        continue
      if isinstance(outcome, _Relaid):
        interruptions = interruptions.relaid(began, outcome.came_back)
        self._laid_out, state = outcome.laid_out, outcome.state
        continue
      state, step = outcome.state, step + 1
      events = interruptions.events(step, self.layout, self.config.grad_accum, processes_of(self.layout))
      yield StepDone(step, state, outcome.metrics, outcome.stop, events, outcome.eval_loss)
      interruptions = Interruptions()

  def _step(self, state, step: int, stop, live) -> _Stepped:
    """Step `step` + 1 on the current layout, the stop vote, and the evaluation where due."""
    config, layout = self.config, self.layout
    batch = data.global_batch(self._split, seed=config.seed, step=step, batch_size=config.batch_size,
                              seq_len=layout.model.max_len, sharding=layout.batch_sharding)
    new_state, metrics = jax.block_until_ready(self.compiled(state, batch))
    stopping = stop.requested(step + 1, config.log_every, live)
    eval_loss = (self._evaluate(self._laid_out.eval_step, layout, new_state["params"])
                 if self._eval_due(step + 1) else None)
    return _Stepped(new_state, metrics, stopping, eval_loss)

  def _shrink_or_grow(self, state, step: int, live) -> _Relaid:
    """The run laid out over the `live` devices, after `step` steps, with `state` moved there."""
    grow = not set(live) <= set(self.layout.mesh.devices.flat)  # a process came back
    laid_out = self._relayout(live, step, grow)
    moved = jax.block_until_ready(relocate(state, self.layout, laid_out.layout))
    came_back = tuple(sorted(processes_of(laid_out.layout) - processes_of(self.layout))) if grow else None
    return _Relaid(laid_out, moved, came_back)

  def _relayout(self, live, step: int | None = None, grow: bool = False) -> LaidOut:
    """The layout over the live devices: fewer replicas after a loss, and after a rejoin as many as
    the run's own config fits on them (all of them back: the run's own layout). `step`, the steps
    done, names the failed one in a refusal; a rejoining process does not know it yet."""
    config, shape = self._first if grow else (self.config, dict(self.layout.mesh.shape))
    smaller, why = shrunk_config(config, shape, len(live))
    why = survival_problem(self.layout) or why  # a lost shard first: no mesh brings it back
    layout = None
    if why is None:
      try:
        layout = plan(smaller, devices=live)
      except ValueError as refusal:  # the model does not divide over the smaller mesh
        why = str(refusal).rstrip(".")
    if layout is None:
      event = "a process came back" if grow else f"a process was lost before step {step + 1}"
      raise ValueError(f"{event} and the run cannot go on over the {len(live)} live devices: {why}; run the "
                       "same command again to resume from the last checkpoint.")
    return LaidOut(layout, smaller, *self._compile_steps(layout, smaller))


class SurvivingStepper(Stepper):
  """The loop's steps in survive mode, a Survivor's; a process started again (`state` None) rejoins
  the run in progress here and takes its state from a live replica."""

  def __init__(self, config, layout: Layout, state: dict | None, train_split, val_split, stop):
    # Each live-device count compiles once per machine: a shrink met again (or a restart) reads it back.
    if not jax.config.jax_compilation_cache_dir:
      jax.config.update("jax_compilation_cache_dir", os.path.join(config.workdir, "compilation_cache"))
    self._survivor = Survivor(config, layout, train_split,
                              evaluate=functools.partial(eval_loss, split=val_split, config=config),
                              eval_due=functools.partial(eval_due, config), joining=state is None)
    # What the first step tells of the time before it: on a process started again, that it rejoined.
    self._stop, self._first_tells = stop, Interruptions()
    if state is None:
      state, self._first_tells = self._survivor.rejoin(abstract_inputs(layout, config)[0])
    self.state = state
    self.peak_bytes = analysis.memory_summary(self._survivor.compiled)["peak_bytes"]

  @property
  def layout(self) -> Layout:
    return self._survivor.layout

  def steps(self) -> Iterator[StepDone]:
    for done in self._survivor.steps(self.state, int(self.state["step"]), self._stop, self._first_tells):
      self.state = done.state
      yield done

  def evaluate(self, done: StepDone) -> float:
    return done.eval_loss  # evaluated inside the step's block: a process lost during it fails the step


def processes_of(layout: Layout) -> set[int]:
  return {device.process_index for device in layout.mesh.devices.flat}


def compiled_steps(layout: Layout, config):
  """The train step (keeping its input: a failed step is redone from it) and the eval step, both
  compiled now: a process compiling inside a step's block would keep the others waiting in its
  collectives, and a wait as long as the heartbeat reads as a lost process."""
  state, batch = abstract_inputs(layout, config)
  train_step = make_train_step(layout, config, donate=False).lower(state, batch).compile()
  return train_step, make_eval_step(layout).lower(state["params"], batch).compile() if config.eval_every else None


def leave_together(devices) -> None:
  """Ends the run on every live process with process 0 last: it hosts the coordination service,
  and a process still connected when it goes is aborted at exit."""
  with live_devices(list(devices)):
    pass  # every live process has finished its run
  client = jax_distributed.global_state.client  # as JAX's fault tolerance guide reaches it
  if jax.process_index() != 0:
    jax.distributed.shutdown()
    return
  # A barrier over the processes the service still counts as live: the others leave it by disconnecting.
  while len(client.get_live_nodes(sorted({device.process_index for device in devices}))) > 1:
    time.sleep(0.1)
