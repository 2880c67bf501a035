"""Goodput of a long run under host failures, by Monte Carlo: restarting from checkpoints against surviving.

Goodput is the time the run's steps take at full speed over the wall time the run takes. The model,
simple on purpose (tools/goodput.py prints it as a table):
- Failures: hosts fail independently at one constant rate, so the cluster's failures are a Poisson
  process of rate hosts / host MTBF (exponential gaps, numpy, a stated seed). In a trial every
  strategy, and every checkpoint interval tried, meets the same failures.
- checkpoint-restart: a blocking save (the async save's blocking part) after every I seconds of
  steps and after the last step. A failure loses the work since the last completed save, a save in
  flight with it, and costs detect + restart + restore + recompile seconds, after which the run goes
  on at full size (a spare host took the lost one's place); a failure during a recovery starts it
  over. I is swept for the best goodput, beside Young/Daly's sqrt(2 x save x cluster MTBF).
- survive with layout redundancy (every shard on two hosts): a failure costs detect + relayout +
  recompile seconds and the step in flight, which is redone. The run then goes on without the lost
  host's replica (max(devices per host, replica devices) devices): the same global batch on fewer
  devices, at their share of the throughput, until a spare host rejoins `replace_hours` later, with
  a pause of `relayout` seconds (the full-size step was compiled at the start).
- survive with peer copies every K steps: the same, but the survivors roll back to the last copy and
  redo the steps since (0 to K, as the failure lands), and every step costs `copy_overhead` more: the
  overhead measured at that K, not derived from it.
A run that has not finished at HORIZON times its length stops there, with the goodput it had
(below 1 / HORIZON). Left out: a failure that takes both copies of a shard, or process 0's host
(the coordination service: meshlm then restarts from a checkpoint, for 1 failure in `hosts`); slow
hosts; planned maintenance; the saves a surviving run keeps for failures it cannot survive.
"""

import collections
import dataclasses
import math

import numpy as np

# The default failure rate, per host of 8 GPUs. Llama 3 (Meta, 2024, "The Llama 3 Herd of Models",
# section 3.3.4): 419 unexpected interruptions in a 54-day snapshot of 405B pre-training on 16,384 H100s,
# i.e. 2,048 hosts: 2,048 x 54 x 24 h / 419 = 6,335 host-hours between failures, one every 3.1 h on the
# cluster. Kokolis et al. (Meta, 2024, "Revisiting Reliability in Large-Scale Machine Learning Research
# Clusters"): 6.50 failures per 1,000 node-days on RSC-1 (A100s), 3,692 host-hours, which gives their
# projected job MTTF of 1.8 h at 16,384 GPUs; 2.34 on RSC-2, 10,256 host-hours.
LLAMA3_HOST_MTBF_HOURS = 2048 * 54 * 24 / 419
HORIZON = 20  # wall time, in run lengths, after which a run stops: its goodput is below 5% anyway
SWEEP = 2.0 ** (np.arange(-48, 49) / 16)  # checkpoint intervals tried: 1/8 to 8x Young/Daly's, 4.4% apart
FIRST_GAPS = 64  # failure times a trial draws at first, and doubles while it needs more
# The most failure times a plan may draw over its trials: its memory and time grow with them (measured at 10
# million: 150 MB at the peak, two minutes on one CPU core), and tools/goodput.py refuses inputs that would draw more.
MAX_FAILURES = 10_000_000


@dataclasses.dataclass(frozen=True)
class Cluster:
  devices: int
  devices_per_host: int
  host_mtbf_hours: float  # math.inf: hosts never fail

  @property
  def hosts(self) -> int:
    return self.devices // self.devices_per_host

  @property
  def mtbf_seconds(self) -> float:
    """Mean seconds between failures anywhere in the cluster."""
    return self.host_mtbf_hours * 3600 / self.hosts

  @property
  def failures_per_day(self) -> float:
    return 86400 / self.mtbf_seconds


@dataclasses.dataclass(frozen=True)
class Run:
  steps: int
  step_seconds: float

  @property
  def seconds(self) -> float:
    return self.steps * self.step_seconds


@dataclasses.dataclass(frozen=True)
class Recovery:
  """What each recovery path costs, in seconds unless named otherwise."""
  detect: float
  restart: float
  restore: float
  recompile: float
  relayout: float
  save: float  # the blocking part of one checkpoint save
  replace_hours: float  # until a spare host rejoins a surviving run
  copy_overhead: float  # peer copies' share of a step's time


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One strategy's goodput, a value per trial."""
  strategy: str
  every: int  # steps between saves or peer copies; 1 under layout redundancy (the step in flight is redone)
  goodput: np.ndarray


class Failures:
  """One trial's failures as wall-clock gaps, drawn as far as a strategy needs them and kept for the next."""

  def __init__(self, cluster: Cluster, rng: np.random.Generator):
    self._mean, self._rng, self._gaps = cluster.mtbf_seconds, rng, np.empty(0)

  def first(self, n: int) -> np.ndarray:
    if n > len(self._gaps):
      more = n - len(self._gaps)
      drawn = np.full(more, math.inf) if math.isinf(self._mean) else self._rng.exponential(self._mean, more)
      self._gaps = np.concatenate([self._gaps, drawn])
    return self._gaps[:n]


def failures_drawn(cluster: Cluster, run: Run, trials: int) -> float:
  """The failure times a plan is expected to draw at most: each trial's until the horizon (a run that falls that
  far behind meets them all), at least its first FIRST_GAPS."""
  return trials * max(FIRST_GAPS, HORIZON * run.seconds / cluster.mtbf_seconds)


def draw_failures(cluster: Cluster, trials: int, seed: int) -> list[Failures]:
  return [Failures(cluster, np.random.default_rng([seed, trial])) for trial in range(trials)]


def young_daly_seconds(cluster: Cluster, recovery: Recovery) -> float:
  """Young's interval between saves, sqrt(2 x save x MTBF), first order in save / MTBF (Daly's too)."""
  return math.sqrt(2 * recovery.save * cluster.mtbf_seconds)


def _outcome(strategy: str, every: int, trials: list[tuple[float, float]]) -> Outcome:
  """From each trial's seconds of steps done and wall seconds."""
  done, wall = np.array(trials).T
  return Outcome(strategy, every, done / wall)


def _restart_trial(failures: Failures, run: Run, recovery: Recovery, every: int) -> tuple[float, float]:
  """Work done and wall seconds of one run that saves every `every` steps and restarts from the last save."""
  interval = every * run.step_seconds
  saves = -(-run.steps // every)
  down = recovery.detect + recovery.restart + recovery.restore + recovery.recompile
  # After each failure the run starts again from a save, so each gap between failures is on its own:
  # the recovery, then whole cycles of steps and a save, then the lost rest. Gaps drawn until one is
  # long enough for the run to finish in it, or past the horizon.
  n = FIRST_GAPS
  while True:
    gaps = failures.first(n)
    working = gaps - down
    working[0] = gaps[0]  # the run's start needs no recovery
    saved = np.minimum(np.floor(np.maximum(working, 0) / (interval + recovery.save)), saves)
    before = np.concatenate([[0], np.cumsum(saved)[:-1]])
    finish = (run.seconds - before * interval) + (saves - before) * recovery.save
    done = np.flatnonzero(working >= finish)
    if done.size:
      last = done[0]
      return run.seconds, gaps[:last].sum() + (down if last else 0) + finish[last]
    if gaps.sum() > HORIZON * run.seconds:
      return (before[-1] + saved[-1]) * interval, gaps.sum()
    n *= 2


def checkpoint_restart(trials: list[Failures], run: Run, recovery: Recovery, every: int) -> Outcome:
  return _outcome("checkpoint-restart", every, [_restart_trial(f, run, recovery, every) for f in trials])


def best_checkpoint_interval(trials: list[Failures], cluster: Cluster, run: Run, recovery: Recovery) -> Outcome:
  """The interval in whole steps of the best mean goodput, swept around Young/Daly's."""
  guess = young_daly_seconds(cluster, recovery) / run.step_seconds  # inf or nan without failures
  scaled = guess * SWEEP if math.isfinite(guess) else [run.steps]
  intervals = np.unique(np.clip(np.rint(scaled), 1, run.steps)).astype(int)
  return max((checkpoint_restart(trials, run, recovery, int(every)) for every in intervals),
             key=lambda outcome: outcome.goodput.mean())


def _survive_trial(failures: Failures, run: Run, recovery: Recovery, every: int, overhead: float,
                   lost: float) -> tuple[float, float]:
  """Work done and wall seconds of one run that survives every failure: a loop over failures and rejoins."""
  pause = recovery.detect + recovery.relayout + recovery.recompile
  gaps, failed = failures.first(FIRST_GAPS), 0  # failed: failures so far, the index of the next gap
  now = done = busy_until = 0.0  # done: seconds of steps at full speed since the start
  next_failure, rejoins = gaps[0], collections.deque()  # when each lost host's spare comes back
  while True:
    failing = not rejoins or next_failure <= rejoins[0]
    event = next_failure if failing else rejoins[0]
    speed = max(0.0, 1 - lost * len(rejoins)) / (1 + overhead)
    start = max(now, busy_until)
    if speed > 0 and start < event:
      finish = start + (run.seconds - done) / speed
      if finish <= event:
        return run.seconds, finish
      done += (event - start) * speed
    now = event
    if now > HORIZON * run.seconds:
      return done, now
    if failing:
      done -= done % (every * run.step_seconds)  # back to the last copy, or the start of the step in flight
      rejoins.append(now + recovery.replace_hours * 3600)
      busy_until = max(busy_until, now + pause)  # a failure during a relayout starts it over
      failed += 1
      if failed == len(gaps):
        gaps = failures.first(2 * failed)
      next_failure = now + gaps[failed]
    else:
      rejoins.popleft()
      busy_until = max(busy_until, now + recovery.relayout)


def _survive(strategy: str, trials: list[Failures], cluster: Cluster, run: Run, recovery: Recovery, every: int,
             overhead: float, replica_devices: int) -> Outcome:
  lost = max(cluster.devices_per_host, replica_devices) / cluster.devices
  return _outcome(strategy, every, [_survive_trial(f, run, recovery, every, overhead, lost) for f in trials])


def layout_redundancy(trials: list[Failures], cluster: Cluster, run: Run, recovery: Recovery,
                      replica_devices: int) -> Outcome:
  return _survive("survive: layout redundancy", trials, cluster, run, recovery, 1, 0.0, replica_devices)


def peer_copies(trials: list[Failures], cluster: Cluster, run: Run, recovery: Recovery, every: int,
                replica_devices: int) -> Outcome:
  return _survive("survive: peer copies", trials, cluster, run, recovery, every, recovery.copy_overhead,
                  replica_devices)


def plan(cluster: Cluster, run: Run, recovery: Recovery, *, peer_copy_every: int, replica_devices: int,
         trials: int, seed: int) -> list[Outcome]:
  """The three strategies over the same failures: checkpoint-restart at its best interval, then both survive modes."""
  failures = draw_failures(cluster, trials, seed)
  return [best_checkpoint_interval(failures, cluster, run, recovery),
          layout_redundancy(failures, cluster, run, recovery, replica_devices),
          peer_copies(failures, cluster, run, recovery, peer_copy_every, replica_devices)]
