"""Checkpointless training: when a process dies, the live ones redo the step without it (fault_tolerance=survive).

Each step runs inside `jax.live_devices` (JAX's fault-tolerant multi-controller mode): the block
either succeeds on every live process or raises on every one. When a process is lost, the others
shrink `data` to the devices left, rebuild each state leaf from the copies they hold, with nothing
read from disk (data parallelism keeps a full copy per replica, so nothing is sent between
processes; hybrid sharding regroups into groups that divide the live devices and sends each shard
from a live copy: training/state_transfer.py), and redo the failed step at the same global batch:
batch `s` is a pure function of (seed, s), so the lost replica's rows are simply spread over the
survivors, with more gradient accumulation where a device would otherwise hold more rows than
before. A process started again later joins at a step boundary: the mesh grows back and the state
comes from a live replica (training/rejoin.py).
"""

import dataclasses
import math
import time

import jax
from jax._src import distributed as jax_distributed
from jax.experimental.multihost_utils import ProcessFailureError, live_devices

from parallel.mesh import AXES, DATA, EXPERT, PIPELINE
from parallel.redundancy import survival_problem
from training import data
from training.dry_run import abstract_inputs
from training.state_transfer import relocate, share_state
from training.state import Layout, plan
from training.step import make_eval_step, make_train_step


@dataclasses.dataclass(frozen=True)
class Failure:
  """One lost process (or several lost together), as the run survived it."""
  step: int  # the step that failed and was redone
  lost_processes: tuple[int, ...]
  live_devices: int
  grad_accum: int  # after the shrink
  recovery_seconds: float  # from the failed step's start to the redone step's end, of which
  detect_seconds: float  # until every live process knew (heartbeat and collective timeouts)
  relayout_seconds: float  # the smaller mesh: moving the state and compiling the step
  steps_lost: int = 0  # the redone step is the one that failed: no finished step is lost


@dataclasses.dataclass(frozen=True)
class Finished:
  """A step done, as the training loop receives it."""
  step: int  # 1-based, as logged
  state: dict
  metrics: dict  # on device
  failure: Failure | None = None  # the lost processes this step was redone without
  stop: bool = False  # the processes agreed to stop here (a signal)
  eval_loss: float | None = None  # computed with the step where it must survive a lost process too
  rejoined: tuple[int, ...] = ()  # the processes that came back before this step
  rejoin_seconds: float = 0.0  # the live processes' pause for them: compiling the grown step, sending the state


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


class Survivor:
  """Train steps that outlive lost processes; `steps()` yields each finished one."""

  def __init__(self, config, layout: Layout, split, evaluate, eval_due, compile_steps=None, joining=False):
    """`joining`: this process was started again into a run in progress; `rejoin` is its first call."""
    self.config, self.layout, self._split = config, layout, split
    self._evaluate, self._eval_due = evaluate, eval_due  # evaluate(eval_step, layout, params) -> loss
    self._compile_steps = compile_steps or compiled_steps  # (layout, config) -> (train step, eval step)
    self._all_devices = list(layout.mesh.devices.flat)
    self._first = config, dict(layout.mesh.shape)  # what a mesh grown back to every device runs
    self._rejoined, self._rejoin_seconds = (), 0.0  # processes that came back, told with the next finished step
    self.compiled, self._eval_step = (None, None) if joining else self._compile_steps(layout, config)

  def rejoin(self, abstract_state) -> dict:
    """The run's state on the grown mesh, sent from a live replica, on a process started again.

    Waits in the live processes' next step boundary, where they see more live devices than their
    mesh and grow it (`steps`): the same block, the same layout and the same transfer on both sides.
    """
    while True:
      began = time.perf_counter()
      try:
        with live_devices(self._all_devices) as live:
          relaid = self._relayout(live, grow=True)
          state = jax.block_until_ready(share_state(abstract_state, relaid[0], holders=()))
      except ProcessFailureError:
        continue  # a process lost during the transfer: the live ones lay out again, and so does this one
      self._rejoined, self._rejoin_seconds = (jax.process_index(),), time.perf_counter() - began
      self.layout, self.config, (self.compiled, self._eval_step) = relaid
      return state

  def steps(self, state, start: int, stop):
    """Yields each Finished step up to config.steps.

    The processes vote on a stop request, and evaluate when it is due, inside the same block as
    the step: a process lost during either fails the block, like one lost during the step.
    """
    config, step, failed = self.config, start, None  # failed: what Failure needs, while one is handled
    while step < config.steps:
      began = time.perf_counter()
      try:
        with live_devices(self._all_devices) as live:
          if set(live) != set(self.layout.mesh.devices.flat):
            # Relaid out in a block of its own: its closing barrier lines the processes up again
            # before the next step's collectives, whatever each spent compiling.
            grow = not set(live) <= set(self.layout.mesh.devices.flat)  # a process came back
            relaid = self._relayout(live, step, grow)
            moved = jax.block_until_ready(relocate(state, self.layout, relaid[0]))
            new_state = None
          else:
            batch = data.global_batch(self._split, seed=config.seed, step=step, batch_size=config.batch_size,
                                      seq_len=self.layout.model.max_len, sharding=self.layout.batch_sharding)
            new_state, metrics = jax.block_until_ready(self.compiled(state, batch))
            stopping = stop.requested(step + 1, config.log_every, live)
            eval_loss = (self._evaluate(self._eval_step, self.layout, new_state["params"])
                         if self._eval_due(step + 1) else None)
      except ProcessFailureError:
        failed = failed or {"began": began, "known": time.perf_counter(),
                            "processes": processes_of(self.layout), "relayout": 0.0}
        continue
      if new_state is None:
        if grow:
          self._rejoined = tuple(sorted(processes_of(relaid[0]) - processes_of(self.layout)))
          self._rejoin_seconds = time.perf_counter() - began
        self.layout, self.config, (self.compiled, self._eval_step) = relaid
        state = moved
        if failed:  # a shrink after a loss; a mesh growing back follows no failure
          failed["relayout"] += time.perf_counter() - began
        continue
      state, step = new_state, step + 1
      failure = None
      if failed:
        lost = tuple(sorted(failed["processes"] - processes_of(self.layout)))
        failure = Failure(step=step, lost_processes=lost,
                          live_devices=self.layout.mesh.size, grad_accum=self.config.grad_accum,
                          recovery_seconds=time.perf_counter() - failed["began"],
                          detect_seconds=failed["known"] - failed["began"], relayout_seconds=failed["relayout"])
        failed = None
      rejoined, self._rejoined = self._rejoined, ()
      yield Finished(step, state, metrics, failure, stopping, eval_loss, rejoined, self._rejoin_seconds)
      self._rejoin_seconds = 0.0

  def _relayout(self, live, step: int | None = None, grow: bool = False):
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
    return layout, smaller, self._compile_steps(layout, smaller)


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
