"""config.nonfinite: when updates not applied (a non-finite loss, gradient or update) end the run."""


class NonfiniteUpdates:
  """Checked at each log step: `stop` ends the run at the first update skipped since the last check;
  `skip` tolerates the odd bad step, not a run that has stopped learning (more than half skipped)."""

  def __init__(self, policy: str, step: int, skipped: int):
    """`skipped`: the updates skipped before `step`, the run's count so far (a resumed run's too)."""
    self._policy, self._step, self._skipped = policy, step, skipped

  def refusal(self, step: int, skipped: int) -> str | None:
    """Why the run ends at `step`, with `skipped` updates skipped so far; None to go on. The loop saves
    the state at `step` before refusing: skipped steps left it as it was, so it is good."""
    interval, newly = step - self._step, skipped - self._skipped
    self._step, self._skipped = step, skipped
    if not newly or (self._policy != "stop" and 2 * newly <= interval):
      return None
    advice = ("Lower optimizer.lr or set nonfinite=skip." if self._policy == "stop" else
              "More than half were skipped, so the run is not learning: lower optimizer.lr.")
    return (f"step {step}: {newly} of the last {interval} updates had a non-finite loss, gradient or update "
            f"and were not applied; the last good state is saved as step {step}. {advice}")
