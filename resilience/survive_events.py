"""What befell a surviving run's processes between two steps (fault_tolerance=survive), told to the
loop with the next step done: each event knows its metrics record and its log line."""

import dataclasses
import time

from training.state import Layout


@dataclasses.dataclass(frozen=True)
class ProcessesLost:
  """Processes lost during a step, which the live ones redid without them: from the state they
  held, or rolled back to the last peer copy (the steps since done again before it)."""
  changes_processes = True
  step: int  # the first step done after the loss: the failed one, or the first redone
  failed_step: int
  rolled_back_to: int | None  # the peer copy's step, where the state was rebuilt from copies
  processes: tuple[int, ...]
  live_devices: int
  mesh: dict  # the shape the step was redone on
  grad_accum: int  # after the shrink
  recovery_seconds: float  # from the failed step's start to the redone step's end, of which
  detect_seconds: float  # until every live process knew (heartbeat and collective timeouts)
  recompile_seconds: float  # laying out over the live devices and compiling the step there
  relayout_seconds: float  # moving (or rebuilding) the state onto the new mesh

  @property
  def steps_lost(self) -> int:
    """Steps that had finished and were done again."""
    return 0 if self.rolled_back_to is None else self.failed_step - 1 - self.rolled_back_to

  def record(self) -> dict:
    return {"steps_lost": self.steps_lost, "failed_step": self.failed_step, "recovery_seconds": self.recovery_seconds, "detect_seconds": self.detect_seconds,
            "recompile_seconds": self.recompile_seconds, "relayout_seconds": self.relayout_seconds,
            "live_devices": self.live_devices}

  def line(self) -> str:
    redone = ("redid the step" if self.rolled_back_to is None else
              f"rolled back to the peer copy of step {self.rolled_back_to} and redid steps "
              f"{self.rolled_back_to + 1}..{self.failed_step}")
    return (f"step {self.step:6d}  lost process {', '.join(map(str, self.processes))} during step "
            f"{self.failed_step}: {redone} on {self.live_devices} devices, mesh {self.mesh}, grad_accum "
            f"{self.grad_accum}, {self.recovery_seconds:.1f} s from the failure ({self.detect_seconds:.1f} s "
            f"to detect it, {self.recompile_seconds:.1f} s to compile, {self.relayout_seconds:.1f} s to move the "
            f"state), {self.steps_lost} step{'' if self.steps_lost == 1 else 's'} lost")


@dataclasses.dataclass(frozen=True)
class ProcessesRejoined:
  """Processes started again that joined the run before a step."""
  changes_processes = True
  step: int  # the first step they took part in
  processes: tuple[int, ...]
  live_devices: int
  mesh: dict  # the shape the step ran on
  grad_accum: int
  seconds: float  # the live processes' pause for them: compiling the grown step, sending the state

  def record(self) -> dict:
    return {"live_devices": self.live_devices, "rejoin_seconds": self.seconds}

  def line(self) -> str:
    return (f"step {self.step:6d}  process {', '.join(map(str, self.processes))} rejoined: the step ran on "
            f"{self.live_devices} devices, mesh {self.mesh}, grad_accum {self.grad_accum}, after "
            f"{self.seconds:.1f} s to lay out again and send the state from a live replica")


@dataclasses.dataclass(frozen=True)
class PeerCopyKept:
  """The first peer copy every live process kept (after a relayout, the first on the new layout)."""
  changes_processes = False
  step: int  # the step it holds the state of
  every: int
  bytes_sent: int  # by all processes, device to device
  host_bytes: int  # in this process's host memory: its own distinct shards and its peer's

  def record(self) -> dict:
    return {"peer_copy_bytes_sent": self.bytes_sent, "peer_copy_host_bytes": self.host_bytes}

  def line(self) -> str:
    return (f"step {self.step:6d}  peer copy kept (one every {self.every} steps): {self.bytes_sent / 2**20:.2f} MiB "
            f"sent between processes, {self.host_bytes / 2**20:.2f} MiB in process 0's host memory (its own "
            "shards and its peer's)")


@dataclasses.dataclass(frozen=True)
class Interruptions:
  """What befell the run since its last step done, gathered block by block and told with the next."""
  rejoined: tuple[int, ...] = ()  # the processes that came back
  rejoin_seconds: float = 0.0
  failed_at: float | None = None  # when the first block that failed began (time.perf_counter)
  known_at: float = 0.0  # when every live process knew of the loss
  before: frozenset[int] = frozenset()  # the run's processes before the loss
  failed_step: int = 0  # the step the first failed block was taking
  recompile_seconds: float = 0.0
  relayout_seconds: float = 0.0
  rolled_back_to: int | None = None  # the peer copy's step, where the state was rebuilt from copies

  def failed(self, began: float, processes: set[int], step: int) -> "Interruptions":
    """After a block from `began` over `processes`, taking step `step`, failed; a recovery is timed
    from the first failure."""
    if self.failed_at is not None:
      return self
    return dataclasses.replace(self, failed_at=began, known_at=time.perf_counter(), before=frozenset(processes),
                               failed_step=step)

  def compiled(self, began: float) -> "Interruptions":
    """After a block from `began` laid the run out over the live devices and compiled its step."""
    took = time.perf_counter() - began
    if self.failed_at is None:  # a mesh growing back follows no failure: part of the rejoin
      return dataclasses.replace(self, rejoin_seconds=self.rejoin_seconds + took)
    return dataclasses.replace(self, recompile_seconds=self.recompile_seconds + took)

  def relaid(self, began: float, came_back: tuple[int, ...] | None, rolled_back_to: int | None) -> "Interruptions":
    """After a block from `began` moved the state onto the new layout; `came_back`: the processes back
    where it grew; `rolled_back_to`: the peer copy's step, where the state was rebuilt from copies."""
    took = time.perf_counter() - began
    changes = {} if came_back is None else {"rejoined": came_back, "rejoin_seconds": self.rejoin_seconds + took}
    if rolled_back_to is not None:
      changes["rolled_back_to"] = rolled_back_to
    if self.failed_at is not None:  # a shrink after a loss; a mesh growing back follows no failure
      changes["relayout_seconds"] = self.relayout_seconds + took
    return dataclasses.replace(self, **changes)

  def events(self, step: int, layout: Layout, grad_accum: int, processes: set[int]) -> tuple:
    """The events to tell with `step`, done on `layout` by `processes`."""
    told = []
    if self.rejoined:
      told.append(ProcessesRejoined(step, self.rejoined, layout.mesh.size, dict(layout.mesh.shape), grad_accum,
                                    self.rejoin_seconds))
    if self.failed_at is not None:
      told.append(ProcessesLost(step, self.failed_step, self.rolled_back_to,
                                tuple(sorted(self.before - processes)), layout.mesh.size,
                                dict(layout.mesh.shape), grad_accum,
                                recovery_seconds=time.perf_counter() - self.failed_at,
                                detect_seconds=self.known_at - self.failed_at,
                                recompile_seconds=self.recompile_seconds, relayout_seconds=self.relayout_seconds))
    return tuple(told)
