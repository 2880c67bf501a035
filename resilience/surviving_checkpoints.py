"""A surviving run's checkpoints (fault_tolerance=survive): the saves line up the live processes, a save
that a lost process broke is abandoned while the run goes on, and a process started again into the run in
progress opens them together with the others."""

import jax
import orbax.checkpoint as ocp

from training.checkpoint import Checkpoints


class SurvivingCheckpoints(Checkpoints):
  """The checkpoints of a run that outlives lost processes."""

  def __init__(self, workdir: str, *, joining: bool, log, **options):
    """`joining`: this process was started again into the run in progress; `log` tells an abandoned save in
    a line. `options` are Checkpoints'."""
    self._joining, self._log = joining, log
    super().__init__(workdir, **options)

  def _open(self, multiprocessing: ocp.options.MultiprocessingOptions | None = None) -> ocp.CheckpointManager | None:
    # A joining process opens none at the start: opening lines every process up at a barrier, which the
    # live ones are not at; it opens them with the others in `reopen_for`, once it has rejoined.
    if multiprocessing is None and self._joining:
      return None
    return super()._open(multiprocessing)

  def reopen_for(self, processes: set[int], step: int) -> None:
    """Save with `processes` from `step` on, after some were lost or came back.

    The old manager is dropped unclosed: closing waits at barriers that the lost processes
    would never reach. A save it still had in flight is abandoned, and said so: orbax finishes it in
    a thread that is not a daemon and waits at the lost processes' barrier for up to its 20-minute
    timeout, so this process can only exit after that.
    """
    if self._manager is not None and self._manager.is_saving_in_progress():
      self._log(f"the save of step {self._manager.latest_step()} was in flight when the processes changed; it is "
                "abandoned, and this process may wait up to orbax's 20-minute barrier as it exits.")
    # `since` keeps the barrier names apart from an earlier manager's over the same processes.
    self._manager = self._open(ocp.options.MultiprocessingOptions(
        primary_host=0, active_processes=processes,
        barrier_sync_key_prefix="live-" + "-".join(map(str, sorted(processes))) + f"-since-{step}"))

  def _savable(self, state):
    """A run shrunk to process 0 alone holds every array on that process's devices while the run still
    counts the lost processes, and orbax refuses such arrays in a run of several processes (it takes them
    for pmap's host-local ones); as host arrays they are saved by process 0, the one left, and restore onto
    any mesh like the others."""
    if jax.process_count() == 1:
      return state
    return jax.tree.map(lambda leaf: jax.device_get(leaf) if leaf.is_fully_addressable else leaf, state)

  def _abandoned(self, failure: str, newest: str) -> bool:
    # The survivors recover from the state in memory; the save is left as a temporary folder, and the
    # checkpoints already saved stay as they were.
    self._log(f"a process was lost during a checkpoint save ({failure}); the save was abandoned and the run "
              f"goes on. {newest}.")
    return True
