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
import itertools
import math
import os
import time
from collections.abc import Callable, Iterator

import jax
from jax.experimental.multihost_utils import ProcessFailureError, live_devices
from ml_collections import ConfigDict

from input_pipeline import data
from measure import analysis
from parallel import jax_compat
from parallel.mesh import AXES, DATA, EXPERT, PIPELINE
from resilience.peer_copies import PeerCopies
from resilience.redundancy import lost_shard, survival_problem
from resilience.state_transfer import compile_transfer, relocate, share_state
from resilience.survive_events import Interruptions, PeerCopyKept
from training.state import Layout, abstract_inputs, plan
from training.step import evaluated, make_eval_step, make_train_step
from training.stepper import StepDone, Stepper, eval_due, eval_loss


def shrunk_config(config, mesh_shape: dict, live_count: int, fits=lambda replicas, per_replica: True):
  """`config` for at most `live_count` devices: fewer data-parallel replicas, the same global batch.

  The most replicas that split the batch evenly, each device holding no more rows than before (more
  micro-batches where needed), and that `fits` accepts: where the batch does not divide over every
  live replica, some devices sit out, which keeps the step exact for any batch and any model (padded
  rows would shift a MoE router's statistics). Under hybrid sharding (sharding.fsdp_group=G) the batch
  splits over the data devices of every group, and the groups become the largest that divide both G
  and the replicas: each device then holds G/group times its former share of the sharded state.
  Returns (config, None), or (None, why not) in one sentence.
  """
  group = config.sharding.fsdp_group
  others = replica_shape(mesh_shape, group)[1]
  if live_count < others:
    return None, (f"{live_count} live devices are fewer than one data-parallel replica's "
                  f"{others} devices (the other mesh axes)")
  pipeline_micro = config.pipeline.microbatches if mesh_shape[PIPELINE] > 1 else 1
  before = config.batch_size // (config.grad_accum * pipeline_micro * mesh_shape[DATA] * mesh_shape[EXPERT])
  most = live_count // others
  for replicas in range(most, 0, -1):
    if not fits(replicas, others):
      continue
    shards = replicas if group else replicas * mesh_shape[EXPERT]  # the batch splits over data and expert
    # The fewest micro-batches (a multiple of today's) that keep each device's rows within what it held.
    for grad_accum in range(config.grad_accum, config.batch_size + 1, config.grad_accum):
      rows, left = divmod(config.batch_size, grad_accum * pipeline_micro * shards)
      if not left and rows <= before:
        smaller = config.copy_and_resolve_references()
        for axis in AXES:
          smaller.mesh[axis] = replicas if axis == DATA else 1 if group and axis == EXPERT else mesh_shape[axis]
          # The survivors' devices no longer fill whole slices or hosts: their mesh has one tier.
          smaller.mesh[f"dcn_{axis}"] = 1
        if group:
          smaller.sharding.fsdp_group = math.gcd(group, replicas)
        smaller.grad_accum = grad_accum
        return smaller, None
  return None, (f"batch_size={config.batch_size} splits evenly over no number of data-parallel replicas up "
                f"to {most} that leaves every live process a device")


def replica_shape(mesh_shape, group: int) -> tuple[int, int]:
  """(data-parallel replicas, devices per replica) of a mesh: the batch splits over `data`, and under
  hybrid sharding also over `expert`, where its groups run."""
  batch_axes = (DATA, EXPERT) if group else (DATA,)
  return (math.prod(size for axis, size in mesh_shape.items() if axis in batch_axes),
          math.prod(size for axis, size in mesh_shape.items() if axis not in batch_axes))


def spread(live: list, replicas: int, per_replica: int, process_of=lambda device: device.process_index) -> list:
  """The devices of `replicas` replicas of `per_replica` devices each, from `live`, such that every
  process keeps work where there are devices enough (a process out of the mesh could not read the
  step's metrics): whole runs of consecutive devices (as the mesh was laid out) taken from the
  processes in turn where that covers them all, else devices taken from the processes in turn (a
  model-parallel replica over processes leaves survivors that no whole runs cover)."""
  units = [tuple(live[i:i + per_replica]) for i in range(0, len(live) - per_replica + 1, per_replica)]
  chosen = set(_in_turn(units, lambda unit: process_of(unit[0]))[:replicas])
  devices = [device for unit in units if unit in chosen for device in unit]
  if {process_of(d) for d in devices} == {process_of(d) for d in live}:
    return devices
  return _in_turn(live, process_of)[:replicas * per_replica]


def _in_turn(items: list, process_of) -> list:
  """`items` taken from each process in turn: the first of every process, then the second..."""
  by_process: dict[int, list] = {}
  for item in items:
    by_process.setdefault(process_of(item), []).append(item)
  return [item for turn in itertools.zip_longest(*by_process.values()) for item in turn if item is not None]


@dataclasses.dataclass(frozen=True)
class LaidOut:
  """The run over one set of live devices: its layout, the config it runs there, its compiled steps."""
  layout: Layout
  config: ConfigDict  # the run's own, or shrunk to fit the live devices
  train_step: Callable | None  # None on a process joining, until it is laid out with the live ones
  eval_step: Callable | None  # None without evaluation
  live: frozenset  # the live devices it was laid out over; where the batch does not divide, some sit out


@dataclasses.dataclass(frozen=True)
class _Stepped:
  """A block that ran a step."""
  state: dict
  metrics: dict
  stop: bool
  eval_loss: float | None
  eval_seconds: float
  data_seconds: float


@dataclasses.dataclass(frozen=True)
class _Relaid:
  """A block that laid the run out again over the live devices and moved the state there."""
  laid_out: LaidOut
  state: dict
  came_back: tuple[int, ...] | None  # the processes back, where the mesh grew; None where it shrank
  rolled_back_to: int | None  # the peer copy's step, where the state was rebuilt from copies


class Survivor:
  """Train steps that outlive lost processes; `steps()` yields each one done."""

  def __init__(self, config, layout: Layout, split, evaluate, eval_due, compile_steps=None, joining=False,
               resume_advice=lambda: "run the same command again to resume from the last checkpoint"):
    """`joining`: this process was started again into a run in progress; `rejoin` is its first call.
    `resume_advice()`: what a refusal to go on tells the user to do (the checkpoint there is, if any)."""
    self._split = split
    self._evaluate, self._eval_due = evaluate, eval_due  # evaluate(eval_step, layout, state) -> loss
    # (layout, config) -> (train step, eval step), on batches with loss weights where the data has loss masks.
    self._compile_steps = compile_steps or functools.partial(compiled_steps, weighted=split.mask is not None)
    self._resume_advice = resume_advice
    self._all_devices = list(layout.mesh.devices.flat)
    self._first = config, dict(layout.mesh.shape)  # what a mesh grown back to every device runs
    train_step, eval_step = (None, None) if joining else self._compile_steps(layout, config)
    self._laid_out = LaidOut(layout, config, train_step, eval_step, frozenset(self._all_devices))
    self._copy_every = config.peer_copy_every
    self.copies = self._copies_for(layout)
    # The last copy kept on an earlier layout, until this layout keeps its own: a second loss before
    # then rolls back to it rather than ending the run.
    self._older_copy = None
    self._prepared: LaidOut | None = None  # laid out over the live devices, the state not yet moved
    self._told, self._copies_told = (), None  # events for the next step; the copies whose first was told

  @property
  def layout(self) -> Layout:
    return self._laid_out.layout

  @property
  def config(self):
    return self._laid_out.config

  @property
  def compiled(self):
    return self._laid_out.train_step

  def _copies_for(self, layout: Layout) -> PeerCopies | None:
    """Peer copies where the config asks for them and some shard lives on one process only."""
    if not self._copy_every or len(processes_of(layout)) < 2 or survival_problem(layout) is None:
      return None
    return PeerCopies(layout, self._copy_every)

  def rejoin(self, abstract_state) -> tuple[dict, Interruptions]:
    """On a process started again: the run's state on the grown mesh, sent from a live replica, and
    what its first step tells (that this process rejoined).

    Waits in the live processes' next step boundary, where they see more live devices than their
    mesh and grow it (`steps`): the same block, the same layout and the same transfer on both sides.
    """
    began, laid_out, state = time.perf_counter(), None, None
    while state is None:
      try:
        with live_devices(self._all_devices) as live:
          # As on the live processes (`_shrink_or_grow`): laid out in one block, the state in the next.
          if laid_out is None or laid_out.live != frozenset(live):
            laid_out = self._relayout(live, grow=True)
          else:
            state = jax.block_until_ready(share_state(abstract_state, laid_out.layout, holders=()))
      except ProcessFailureError:
        laid_out = None  # a process lost meanwhile: the live ones lay out again, and so does this one
    self._laid_out = laid_out
    return state, Interruptions(rejoined=(jax.process_index(),), rejoin_seconds=time.perf_counter() - began)

  def steps(self, state, start: int, stop, interruptions: Interruptions = Interruptions()) -> Iterator[StepDone]:
    """Yields each step done up to config.steps, with what befell the processes since the one before.

    `interruptions`: what the first step tells besides its own (a rejoin's, from `rejoin`). The
    processes vote on a stop request, and evaluate when it is due, inside the same block as the step:
    a process lost during either fails the block, like one lost during the step. A step rebuilt from
    peer copies rolls back to their step, and the steps since are done again.
    """
    self._interruptions, self._step_count = interruptions, start
    while self._step_count < self.config.steps:
      began = time.perf_counter()
      try:
        with live_devices(self._all_devices) as live:
          # Relaid out in a block of its own: its closing barrier lines the processes up again
          # before the next step's collectives, whatever each spent compiling.
          outcome = (self._step(state, self._step_count, stop, live) if set(live) == self._laid_out.live
                     else self._shrink_or_grow(state, self._step_count, live))
      except ProcessFailureError:
        self._failed(began)
        continue
      if self.copies:
        kept = self.copies.block_done()
        self._older_copy = None if kept is not None else self._older_copy
        self._tell_first_copy(kept)
      if outcome is None:  # laid out and compiled; the state moves in the next block
        self._interruptions = self._interruptions.compiled(began)
        continue
      if isinstance(outcome, _Relaid):
        self._interruptions = self._interruptions.relaid(began, outcome.came_back, outcome.rolled_back_to)
        self._laid_out, state = outcome.laid_out, outcome.state
        self._older_copy, self.copies = self._last_copy(), self._copies_for(self.layout)
        self._step_count = int(jax.device_get(state["step"]))
        continue
      state, self._step_count = outcome.state, self._step_count + 1
      events = self._interruptions.events(self._step_count, self.layout, self.config.grad_accum,
                                          processes_of(self.layout)) + self._told
      self._interruptions, self._told = Interruptions(), ()
      yield StepDone(self._step_count, state, outcome.metrics, outcome.stop, events, outcome.eval_loss,
                     outcome.eval_seconds, outcome.data_seconds)

  def _tell_first_copy(self, kept) -> None:
    """The first copy kept on a layout is told with the next step: what it sent and what it holds."""
    if kept is not None and self._copies_told is not self.copies:
      self._copies_told = self.copies
      self._told += (PeerCopyKept(kept.step, self.copies.every, self.copies.plan.bytes_sent(self.layout),
                                  kept.host_bytes()),)

  def guarded(self, action: Callable[[], None]) -> bool:
    """Runs `action` (a checkpoint save: its collectives and barriers) in a protected block of its
    own; False where a process was lost during it, which the next step's block then recovers from."""
    began = time.perf_counter()
    try:
      with live_devices(self._all_devices):
        action()
    except ProcessFailureError:
      self._failed(began)
      return False
    return True

  def _failed(self, began: float) -> None:
    """After a block from `began` failed: copies not yet kept are dropped, and the loss is timed."""
    if self.copies:
      self.copies.block_failed()
    self._interruptions = self._interruptions.failed(began, processes_of(self.layout), self._step_count + 1)

  def _step(self, state, step: int, stop, live) -> _Stepped:
    """Step `step` + 1 on the current layout, the stop vote, the evaluation where due, and the peer
    copy: the last one sent arrives during this step, and one of this step's state leaves when due."""
    config, layout = self.config, self.layout
    began = time.perf_counter()
    batch = data.global_batch(self._split, seed=data.data_seed(config), step=step, batch_size=config.batch_size,
                              seq_len=layout.model.max_len, sharding=layout.batch_sharding)
    data_seconds = time.perf_counter() - began
    new_state, metrics = self.compiled(state, batch)
    if self.copies:
      self.copies.before_step()
    new_state, metrics = jax.block_until_ready((new_state, metrics))
    stopping = stop.requested(step + 1, config.log_every, live)
    began = time.perf_counter()
    eval_loss = (self._evaluate(self._laid_out.eval_step, layout, new_state)
                 if self._eval_due(step + 1) else None)
    eval_seconds = time.perf_counter() - began
    if self.copies:
      self.copies.after_step(new_state, step + 1)
    return _Stepped(new_state, metrics, stopping, eval_loss, eval_seconds, data_seconds)

  def _shrink_or_grow(self, state, step: int, live) -> _Relaid | None:
    """The run laid out over the `live` devices, after `step` steps, with `state` moved there: from
    the live devices where they hold every shard, else rolled back to the last peer copy.

    Two blocks: the first lays out and compiles (None), the next moves the state. The barrier that
    closes the first lines the processes up, however long each took to compile, so none waits in
    the transfer's collectives for longer than they wait for a peer (which reads as a lost one).
    """
    grow = not set(live) <= self._laid_out.live  # a process came back
    if self._prepared is None or self._prepared.live != frozenset(live):
      self._prepared = self._relayout(live, step, grow)
      return None
    laid_out, self._prepared = self._prepared, None
    came_back = tuple(sorted(processes_of(laid_out.layout) - processes_of(self.layout))) if grow else None
    if grow or lost_shard(self.layout, live) is None:
      return _Relaid(laid_out, jax.block_until_ready(relocate(state, self.layout, laid_out.layout, live)), came_back, None)
    kept = self._last_copy()
    rebuilt = kept.restore(laid_out.layout, {d.process_index for d in live})
    return _Relaid(laid_out, jax.block_until_ready(rebuilt), came_back, kept.step)

  def _relayout(self, live, step: int | None = None, grow: bool = False) -> LaidOut:
    """The layout over the live devices: fewer replicas after a loss, and after a rejoin as many as
    the run's own config fits on them (all of them back: the run's own layout). `step`, the steps
    done, names the failed one in a refusal; a rejoining process does not know it yet."""
    config, shape = self._first if grow else (self.config, dict(self.layout.mesh.shape))
    ordered = [device for device in self._all_devices if device in set(live)]
    processes = {device.process_index for device in ordered}
    smaller, why = shrunk_config(config, shape, len(ordered),
                                 fits=lambda replicas, per_replica: replicas * per_replica >= len(processes))
    why = (None if grow else self._unrecoverable(live)) or why  # a lost shard first: no mesh brings it back
    layout = None
    if why is None:
      try:
        layout = plan(smaller, devices=spread(ordered, *replica_shape(dict(smaller.mesh), smaller.sharding.fsdp_group)))
      except ValueError as refusal:  # the model does not divide over the smaller mesh
        why = str(refusal).rstrip(".")
    if layout is None:
      event = "a process came back" if grow else f"a process was lost before step {step + 1}"
      raise ValueError(f"{event} and the run cannot go on over the {len(live)} live devices: {why}; "
                       f"{self._resume_advice()}.")
    compile_transfer(layout)
    return LaidOut(layout, smaller, *self._compile_steps(layout, smaller), frozenset(live))

  def _unrecoverable(self, live) -> str | None:
    """Why the state cannot be rebuilt over `live` (one sentence), or None."""
    if len(processes_of(self.layout)) < 2:
      return survival_problem(self.layout)
    lost = lost_shard(self.layout, live)
    if lost is None:
      return None
    if self.copies is None and self._older_copy is None:
      return (f"{lost} has a shard that only a lost process held (the state is sharded over processes, not "
              f"replicated: ZeRO or a model axis spans them), and no peer copies were kept "
              f"(--config.peer_copy_every=K keeps them)")
    copy = self._last_copy()
    if copy is None:
      return f"{lost} has a shard that only a lost process held, and no peer copy had been kept yet"
    return copy.missing({device.process_index for device in live})

  def _last_copy(self):
    """The newest peer copy every live process kept: this layout's, else the older layout's (None: none)."""
    kept = self.copies.kept if self.copies else None
    return kept if kept is not None else self._older_copy


class SurvivingStepper(Stepper):
  """The loop's steps in survive mode, a Survivor's; a process started again (`state` None) rejoins
  the run in progress here and takes its state from a live replica. Where the run's processes change,
  its `checkpoints` (SurvivingCheckpoints) save with the live ones from that step on."""

  def __init__(self, config, layout: Layout, state: dict | None, train_split, val_split, stop, checkpoints):
    # Each live-device count compiles once per machine: a shrink met again (or a restart) reads it back.
    if not jax.config.jax_compilation_cache_dir:
      jax.config.update("jax_compilation_cache_dir", os.path.join(config.workdir, "compilation_cache"))
    self._survivor = Survivor(config, layout, train_split,
                              evaluate=functools.partial(eval_loss, split=val_split, config=config),
                              eval_due=functools.partial(eval_due, config), joining=state is None,
                              resume_advice=checkpoints.resume_advice)
    # What the first step tells of the time before it: on a process started again, that it rejoined.
    self._stop, self._checkpoints, self._first_tells = stop, checkpoints, Interruptions()
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
      if any(event.changes_processes for event in done.events):
        self._checkpoints.reopen_for(processes_of(self.layout), step=done.step)
      yield done

  def evaluate(self, done: StepDone) -> float:
    return done.eval_loss  # evaluated inside the step's block: a process lost during it fails the step

  def guarded(self, action) -> bool:
    return self._survivor.guarded(action)


def processes_of(layout: Layout) -> set[int]:
  return {device.process_index for device in layout.mesh.devices.flat}


def compiled_steps(layout: Layout, config, weighted: bool = False):
  """The train step (keeping its input: a failed step is redone from it) and the eval step, both
  compiled now: a process compiling inside a step's block would keep the others waiting in its
  collectives, and a wait past their patience (parallel/distributed.py) fails the run. Batches carry
  loss weights where `weighted`."""
  state, batch = abstract_inputs(layout, config, weighted)
  train_step = make_train_step(layout, config, donate=False).lower(state, batch).compile()
  return train_step, make_eval_step(layout).lower(evaluated(state), batch).compile() if config.eval_every else None


def leave_together(devices) -> None:
  """Ends the run on every live process with process 0 last: it hosts the coordination service,
  and a process still connected when it goes is aborted at exit."""
  with live_devices(list(devices)):
    pass  # every live process has finished its run
  client = jax_compat.coordination_client()
  if jax.process_index() != 0:
    jax.distributed.shutdown()
    return
  # A barrier over the processes the service still counts as live: the others leave it by disconnecting.
  while len(client.get_live_nodes(sorted({device.process_index for device in devices}))) > 1:
    time.sleep(0.1)
