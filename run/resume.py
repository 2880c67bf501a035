"""Where a run's state comes from: its own checkpoint (config.resume), another run's (config.branch_from),
an imported model (config.init_from) or a fresh start; each checkpoint checked before and after it is read."""

from pathlib import Path

import jax

from run.console import log
from training.checkpoint import Checkpoints, cast_like
from training.state import abstract_inputs, base_params, state_from_params
from training.step import all_finite


def open_branch(branch_from: str, workdir: str) -> tuple[Checkpoints | None, int]:
  """The checkpoints `branch_from` ("<workdir>:<step>") names and its step, checked before anything is
  written; (None, 0) without one."""
  if not branch_from:
    return None, 0
  source, _, step = branch_from.rpartition(":")
  if not source or not step.isdigit():
    raise ValueError(f"branch_from={branch_from!r} is not <workdir>:<step>; e.g. runs/stable:800.")
  if Path(source).resolve() == Path(workdir).resolve():
    raise ValueError(f"branch_from={branch_from!r} names this run's own workdir; resume it with "
                     f"--config.resume={step}, or branch into another --config.workdir.")
  if not (Path(source) / "checkpoints").is_dir():
    raise ValueError(f"branch_from={branch_from!r}: {source} holds no checkpoints; name a run's workdir.")
  branch = Checkpoints(source, every=0, keep=None)
  if int(step) not in branch.steps():
    branch.close()
    raise ValueError(f"branch_from={branch_from!r}: {branch.directory} holds no step {step} (it holds "
                     f"{branch.steps()}); name one of those.")
  return branch, int(step)


def start_state(config, layout, checkpoints: Checkpoints, branch: tuple[Checkpoints | None, int], pretrained,
                ledger, origin: str) -> tuple[int | None, dict]:
  """(the step resumed from, None where the run does not resume, and the state it starts from): this run's
  checkpoint, else the `branch` (open_branch's), else the `pretrained` model's weights (an HFCheckpoint),
  else a fresh state. Another run's checkpoint is refused before its step is measured; `origin` names
  where the run's tokens come from, `ledger` gets the time of a restore."""
  start, (branch, branch_step) = _resume_step(checkpoints, config.resume), branch
  frozen = lambda: base_params(layout, pretrained, config.seed)  # what LoRA's checkpoints leave out
  if start is not None:
    checkpoints.check_same_run(start, config)
    checkpoints.check_tokenizer(start, origin)
    _check_not_past(start, config.steps, checkpoints)
    with ledger.timing("checkpoint_restore"):
      state = restore_good(checkpoints, start, abstract_inputs(layout, config)[0], frozen)
    log(f"resuming from step {start} in {checkpoints.directory}")
  elif branch is not None:
    _check_not_past(branch_step, config.steps, branch)
    branch.check_tokenizer(branch_step, origin)
    with ledger.timing("checkpoint_restore"):
      state = restore_good(branch, branch_step, abstract_inputs(layout, config)[0], frozen, set_aside=False)
    log(f"branching from step {branch_step} in {branch.directory}, which is left as it is")
  else:
    if pretrained is not None:
      log(f"initialising from {pretrained.describe(layout.model)}")
    state = state_from_params(layout, frozen(), config.seed)
  return start, state


def restore_good(checkpoints: Checkpoints, step: int, abstract_state, frozen=None, set_aside: bool = True):
  """Restores `step` (`frozen` gives a LoRA checkpoint's frozen weights), refusing a damaged one; later
  checkpoints (another timeline) are set aside, unless the checkpoints are another run's (`set_aside` False: a
  branch leaves its source as it is)."""
  state = checkpoints.restore(step, abstract_state, frozen)
  changed = checkpoints.changed_leaf(step, state)  # bytes damaged into values that may well be finite
  damage = (f"has changed since it was saved ({changed} does not match its fingerprint)" if changed else
            None if bool(jax.jit(all_finite)(state)) else "holds non-finite values")
  if damage:
    raise ValueError(f"checkpoint step {step} in {checkpoints.directory} {damage}, so it is damaged; "
                     f"it was left untouched: resume from an earlier one with {checkpoints.resume_before(step)}.")
  if not set_aside:
    return cast_like(state, abstract_state)
  # Left in place, a later step would never be rewritten (its number is taken) and would outlive
  # the good checkpoints in rotation; moved aside, it is kept but out of this run's way.
  moved, folder = checkpoints.set_aside_after(step)
  if moved:
    log(f"moved checkpoints {moved} (after step {step}) to {folder}")
  return cast_like(state, abstract_state)


def _check_not_past(start: int, steps: int, checkpoints: Checkpoints) -> None:
  """A checkpoint beyond the last step is a mistake in `steps` or `resume`, which training would hide."""
  if start > steps:
    earlier = [s for s in checkpoints.steps() if s <= steps]
    raise ValueError(f"checkpoint step {start} in {checkpoints.directory} is past steps={steps}; raise "
                     f"--config.steps to train on" + (f", or resume from step {earlier[-1]} with "
                     f"--config.resume={earlier[-1]} (later checkpoints are set aside, not deleted)"
                     if earlier else "") + ".")


def _resume_step(checkpoints: Checkpoints, resume: str) -> int | None:
  """The step to restore, or None for a fresh start; refuses to start over saved work."""
  steps = checkpoints.steps()
  if resume == "never":
    if steps:
      raise ValueError(f"{checkpoints.directory} already holds checkpoints up to step {steps[-1]} and "
                       "resume=never would write over them; resume with --config.resume=auto or "
                       "choose another --config.workdir.")
    return None
  if resume == "auto":
    return steps[-1] if steps else None
  if not resume.isdigit() or int(resume) not in steps:
    raise ValueError(f"resume={resume!r} names no checkpoint in {checkpoints.directory} "
                     f"(it holds steps {steps}); use auto, never or one of those steps.")
  return int(resume)
