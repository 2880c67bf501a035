"""What config.fault_tolerance asks of one process of a run: the checkpoints it saves with, the stepper
that takes its steps, and how it leaves at the end.

Under fault_tolerance=survive, where the layout can outlive a lost process, the steps are a
SurvivingStepper's (resilience/survive.py) and the saves SurvivingCheckpoints'; a process started
again into the run in progress brings no state of its own, and takes a live replica's. Otherwise the
steps are the local stepper's, which the loop hands in: run/local_stepper.py stands a floor above resilience/.
"""

import jax

from resilience.redundancy import survival_problem
from resilience.rejoin import joining_run, refuse_on_cpu
from resilience.survive import SurvivingStepper, leave_together
from resilience.surviving_checkpoints import SurvivingCheckpoints
from training.checkpoint import Checkpoints
from training.stepper import Stepper


class FaultTolerance:
  """One process's part in the run's fault tolerance, decided once the run is laid out."""

  def __init__(self, config, layout, log):
    """Decides whether survive mode protects `layout` (`log` tells why not, in one line) and whether this
    process joins a run in progress, which the CPU refuses: both before anything is compiled or saved."""
    self._survive = config.fault_tolerance == "survive"
    self._surviving = self._survive and _protects(config, layout, log)
    self._joining = self._surviving and joining_run()
    if self._joining:
      refuse_on_cpu()
    self._log = log

  @property
  def brings_state(self) -> bool:
    """Whether the stepper brings the state it starts from (a process started again into a run in
    progress takes a live replica's): the loop then neither resumes nor initialises one."""
    return self._joining

  def checkpoints(self, workdir: str, **options) -> Checkpoints:
    """The run's checkpoints in `workdir`; `options` are Checkpoints'."""
    if not self._surviving:
      return Checkpoints(workdir, **options)
    return SurvivingCheckpoints(workdir, joining=self._joining, log=self._log, **options)

  def stepper(self, local, config, layout, state, train_split, val_split, stop, checkpoints) -> Stepper:
    """The stepper from `state` (None where it brings its own); `local(config, layout, state, train_split,
    val_split, stop)` makes the one for a run that survive mode does not protect."""
    if not self._surviving:
      return local(config, layout, state, train_split, val_split, stop)
    return SurvivingStepper(config, layout, state, train_split, val_split, stop, checkpoints)

  def leave(self) -> None:
    """After the run: the processes of a run in survive mode leave together, process 0 last."""
    if self._survive and jax.process_count() > 1:
      leave_together(jax.devices())


def _protects(config, layout, log) -> bool:
  """Whether fault_tolerance=survive can protect this run from a lost process; where not, says why in one line."""
  problem = survival_problem(layout)
  if problem and config.peer_copy_every and jax.process_count() > 1:
    return True  # the shards on one process are copied into another's memory
  if problem:
    copies = "" if jax.process_count() < 2 else "; --config.peer_copy_every=K would keep copies of it in host memory"
    log(f"fault_tolerance=survive cannot protect this layout: {problem}{copies}; a lost process will end the "
        "run, and the same command resumes it from the last checkpoint.")
    return False
  return True
