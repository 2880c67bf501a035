"""`config.profile_steps`: a jax.profiler trace of chosen train steps, for TensorBoard or Perfetto.

The trace lands in <workdir>/profile/plugins/profile/<run>/ as `*.xplane.pb`
(`tensorboard --logdir <workdir>/profile`, Profile tab) and
`perfetto_trace.json.gz` (open it at https://ui.perfetto.dev).
"""

import contextlib
import os

import jax


def parse_steps(text: str, last_step: int) -> tuple[int, int] | None:
  """`"FIRST,LAST"` as two step numbers within 1..last_step, or None for an empty string."""
  if not text:
    return None
  parts = text.split(",")
  if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
    raise ValueError(f"profile_steps={text!r} is not two step numbers; write FIRST,LAST, e.g. 10,12.")
  first, last = (int(p) for p in parts)
  if not 1 <= first <= last <= last_step:
    raise ValueError(f"profile_steps={text!r} must satisfy 1 <= FIRST <= LAST <= steps={last_step}.")
  return first, last


def profile_dir(workdir: str) -> str:
  return os.path.join(workdir, "profile")


class StepProfiler:
  """Starts a trace before step FIRST and stops it once step LAST has run on the device.

  Outside the window it costs nothing; the one host sync it adds is at LAST,
  so that the trace holds the device work of every traced step.
  """

  def __init__(self, window: tuple[int, int] | None, workdir: str):
    self._window, self._log_dir, self._active = window, profile_dir(workdir), False

  def before(self, step: int) -> None:
    if self._window and step == self._window[0] and jax.process_index() == 0:
      jax.profiler.start_trace(self._log_dir, create_perfetto_trace=True)
      self._active = True

  def annotate(self, step: int):
    """Marks one step in the trace, so TensorBoard's overview breaks time down per step."""
    return jax.profiler.StepTraceAnnotation("train", step_num=step) if self._active else contextlib.nullcontext()

  def after(self, step: int, outputs) -> None:
    if self._active and step == self._window[1]:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()
