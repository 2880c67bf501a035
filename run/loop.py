"""The training loop: plan the layout, resume or initialise, then log, evaluate, save and stop around
the steps a stepper takes (training/stepper.py: on the mesh as planned, or surviving lost processes)."""

import contextlib
import time
from pathlib import Path

import jax
from tqdm import tqdm

from input_pipeline import data
from input_pipeline.tokenizer import run_tokenizer
from interop import hf_checkpoint
from measure import goodput
from measure.dry_run import report
from measure.goodput import Ledger, steps_logged
from measure.profiling import parse_steps
from parallel import distributed
from resilience.preemption import StopRequests
from resilience.redundancy import survival_problem
from resilience.rejoin import joining_run, refuse_on_cpu
from resilience.survive import SurvivingStepper, leave_together, processes_of
from resilience.workdir_lock import WorkdirLock
from run.local_stepper import LocalStepper
from run.nonfinite import NonfiniteUpdates
from training import metrics
from training.checkpoint import Checkpoints, cast_like, data_record, tokenizer_record
from training.sample import check_request, encode_prompt, generate
from training.state import abstract_inputs, active_param_count, init_state, param_count, plan, state_from_params
from training.step import all_finite
from training.stepper import Stepper, eval_due
from training.validate import check_run

SAMPLE_TEMPERATURE = 0.8  # the closing sample's; sample.py takes any


def train(config, dry_run: bool = False) -> dict:
  """Train per `config`; returns the last logged metrics (and the final eval loss, if any)."""
  ledger = Ledger(done_before=steps_logged(config.workdir))  # what this start does again was done before
  distributed.initialize(config.distributed, survive=config.fault_tolerance == "survive")
  pretrained = hf_checkpoint.open_init_from(config.init_from)
  if pretrained is not None:
    pretrained.configure(config)  # the checkpoint decides the model's shape
  check_run(config)
  distributed.check_same_config(config)
  train_split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  val_split = data.open_split(config.data, "val", vocab_size=config.model.vocab_size)
  # An imported checkpoint's own tokenizer wins; token data another tokenizer wrote is refused here.
  text_tokenizer = run_tokenizer(config.init_from, train_split.tokenizer, train_split.origin)
  config.data.loss_mask = train_split.mask is not None  # the batches then carry loss weights
  if config.data.segments:  # packed documents end at the tokenizer's end-of-text, which the token files hold
    config.model.document_end = text_tokenizer.end_of_text
  layout = plan(config)  # refuses a bad mesh or model before anything compiles
  data.check_long_enough(train_split, layout.model.max_len)  # here, not after compiling
  if config.eval_every:
    data.check_long_enough(val_split, layout.model.max_len)
  if config.sample_tokens:
    prompt = encode_prompt(text_tokenizer, config.sample_prompt)
    check_request(layout.model.max_len, len(prompt), config.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                  top_k=0, vocab_size=layout.model.vocab_size)
  parse_steps(config.profile_steps, config.steps)
  if dry_run:
    text = report(layout, config)
    _log(text)
    return {"report": text}

  surviving = config.fault_tolerance == "survive" and _protects(config, layout)
  # A process started again into a surviving run takes its state from a live replica, never from disk.
  joining = surviving and joining_run()
  if joining:
    refuse_on_cpu()
  # Synthetic data carries no text: its checkpoints record no tokenizer, and resume on any.
  synthetic = train_split.origin == "synthetic"
  branch, branch_step = _open_branch(config.branch_from, config.workdir)
  checkpoints = Checkpoints(config.workdir, every=config.checkpoint.every, keep=config.checkpoint.keep,
                            joining=joining, tokenizer=None if synthetic else tokenizer_record(text_tokenizer),
                            data=None if synthetic else data_record(config.data.source, train_split),
                            surviving_log=_log if surviving else None)
  lock = WorkdirLock(config.workdir) if jax.process_index() == 0 else contextlib.nullcontext()
  try:
    # Signals are recorded from here on, so a SIGTERM while compiling still ends the run cleanly.
    with StopRequests() as stop, lock:
      start = None if joining else _resume_step(checkpoints, config.resume)
      if start is not None:  # another run's checkpoint is named before its step is measured
        checkpoints.check_same_run(start, config)
        checkpoints.check_tokenizer(start, train_split.origin)
        _check_not_past(start, config.steps, checkpoints)
      elif branch is not None:
        _check_not_past(branch_step, config.steps, branch)
        branch.check_tokenizer(branch_step, train_split.origin)
      if joining:  # never process 0, which hosts the coordination service: process 0 logs the rejoin
        state = None  # the stepper receives it from the live processes
      elif start is None and branch is not None:
        with ledger.timing("checkpoint_restore"):
          state = _restore_good(branch, branch_step, abstract_inputs(layout, config)[0], set_aside=False)
        _log(f"branching from step {branch_step} in {branch.directory}, which is left as it is")
      elif start is None and pretrained is not None:
        _log(f"initialising from {pretrained.describe(layout.model)}")
        state = state_from_params(layout, pretrained.load_params(layout))
      elif start is None:
        state = init_state(layout, config.seed)
      else:
        with ledger.timing("checkpoint_restore"):
          state = _restore_good(checkpoints, start, abstract_inputs(layout, config)[0])
        _log(f"resuming from step {start} in {checkpoints.directory}")
      if start == config.steps:  # restored all the same, so a checkpoint of another model is refused
        _log(f"step {start} is the last of steps={config.steps}: nothing to train; raise --config.steps "
             "to train on.")
        last = {}
      else:
        with ledger.timing("compile"):  # both steppers compile their steps ahead
          stepper = (SurvivingStepper(config, layout, state, train_split, val_split, stop,
                                      resume_advice=checkpoints.resume_advice) if surviving else
                     LocalStepper(config, layout, state, train_split, val_split, stop))
        ledger.add("startup", ledger.unaccounted())  # everything before the first step but the above
        last = _run(config, stepper, checkpoints, stop, text_tokenizer, ledger)
  finally:
    checkpoints.close()
    if branch is not None:
      branch.close()
  if config.fault_tolerance == "survive" and jax.process_count() > 1:
    leave_together(jax.devices())
  return last


def _open_branch(branch_from: str, workdir: str) -> tuple[Checkpoints | None, int]:
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


def _restore_good(checkpoints: Checkpoints, step: int, abstract_state, set_aside: bool = True):
  """Restores `step`, refusing a damaged one; later checkpoints (another timeline) are set aside, unless
  the checkpoints are another run's (`set_aside` False: a branch leaves its source as it is)."""
  state = checkpoints.restore(step, abstract_state)
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
    _log(f"moved checkpoints {moved} (after step {step}) to {folder}")
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


def _run(config, stepper: Stepper, checkpoints: Checkpoints, stop: StopRequests, text_tokenizer,
         ledger: Ledger) -> dict:
  """Trains with `stepper` from its state to config.steps: logs, evaluates, saves and stops; `ledger`
  gets the time of each, and is written with each log step and told at the end."""
  state, layout = stepper.state, stepper.layout
  start = int(state["step"])
  if stop.signal_name and jax.process_count() == 1:  # several processes agree at the first log step
    _log(f"stopped by {stop.signal_name} before step {start + 1}; nothing new to save.")
    return {}
  flops_token = metrics.flops_per_token(layout.model, active_param_count(layout))
  peak = metrics.peak_flops_per_device(config.peak_tflops)
  writer = metrics.MetricsWriter(config.workdir, after_step=start, config=config)
  active = "" if not layout.model.num_experts else f" ({active_param_count(layout):,} active per token)"
  _log(f"training {param_count(layout):,} parameters{active} on {layout.mesh.size} devices, "
       f"mesh {dict(layout.mesh.shape)}, steps {start}..{config.steps}, writing to {config.workdir}")

  last, interval_start, interval_from, done = {}, time.perf_counter(), start, start
  nonfinite = NonfiniteUpdates(config.nonfinite, start, int(jax.device_get(state["skipped"])))
  tokens_per_step = config.batch_size * layout.model.max_len
  with stepper, writer, tqdm(initial=start, total=config.steps, disable=jax.process_index() != 0,
                             leave=False) as bar:
    for finished in stepper.steps():
      if finished.step <= done:  # a surviving run rolled back to a peer copy: it redoes the steps since
        writer.rewind(finished.step - 1)
        interval_from = min(interval_from, finished.step - 1)  # the redone steps' time counts the recovery's
      done, state = finished.step, finished.state
      ledger.add("data_wait", finished.data_seconds)
      ledger.add("evaluation", finished.eval_seconds)
      bar.update(done - bar.n)
      if any(event.changes_processes for event in finished.events):
        checkpoints.reopen_for(processes_of(stepper.layout), step=done)
      for event in finished.events:
        writer.write(done, event.record())
        ledger.lost_process(event.record())
        _log(event.line())
      if done % config.log_every == 0 or done == config.steps:
        fetched = jax.device_get(finished.metrics)
        tokens_per_sec = (done - interval_from) * tokens_per_step / (time.perf_counter() - interval_start)
        last = {"step": done, "loss": float(fetched["loss"]), "lr": float(fetched["lr"]),
                "grad_norm": float(fetched["grad_norm"]), "tokens_per_sec": tokens_per_sec,
                "mfu": metrics.mfu(tokens_per_sec, flops_token, peak),
                "skipped": int(fetched["skipped"]), "peak_bytes": stepper.peak_bytes, **_optional_figures(fetched)}
        writer.write(done, {k: v for k, v in last.items() if k != "step"})
        if writer.active:  # process 0, as for metrics.jsonl
          ledger.write(config.workdir, done)
        _log(_format(last))
        interval_start, interval_from = time.perf_counter(), done
        refusal = nonfinite.refusal(done, last["skipped"])
        if refusal:
          stepper.guarded(lambda: checkpoints.save_now(done, state, config))  # skipped steps left it good
          raise ValueError(refusal)
      if eval_due(config, done):
        with ledger.timing("evaluation"):
          last["eval_loss"] = stepper.evaluate(finished)
        writer.write(done, {"eval_loss": last["eval_loss"]})
        _log(f"step {done:6d}  eval loss {last['eval_loss']:.4f}")
      ledger.step(done)  # before the save: a save that a lost process broke is the next step's to tell
      # A surviving run saves in a protected block: a process lost during a save abandons the save,
      # and the next step recovers from the loss.
      saving = time.perf_counter()
      saved = stepper.guarded(lambda: checkpoints.save(done, state, config, force=done == config.steps))
      checkpoints.check()  # a failed async save (a full disk) stops the run now, not at the next save
      if saved:  # else the time went to finding the loss, which the next step's event tells the ledger
        ledger.add("checkpoint_save", time.perf_counter() - saving)
      else:
        _log(f"step {done:6d}  a process was lost while saving: the save was abandoned, the checkpoints "
             "saved before it stay readable, and the next step recovers from the loss")
      if finished.stop:
        with ledger.timing("checkpoint_save"):
          stepper.guarded(lambda: checkpoints.save_now(done, state, config))
        _log(f"stopped by {stop.signal_name} after step {done}; saved a checkpoint there, "
             "run the same command to resume.")
        break
    else:
      with ledger.timing("checkpoint_save"):
        checkpoints.wait()
      if config.sample_tokens:
        _log("sample: " + _sample(stepper.layout, state["params"], config, text_tokenizer))
    record = ledger.write(config.workdir, done) if writer.active else ledger.record()
  _log("where the wall time went:\n" + goodput.table({"this run": goodput.attempt_totals(record)}))
  return last


def _protects(config, layout) -> bool:
  """Whether fault_tolerance=survive can protect this run from a lost process; where not, says why in one line."""
  problem = survival_problem(layout)
  if problem and config.peer_copy_every and jax.process_count() > 1:
    return True  # the shards on one process are copied into another's memory
  if problem:
    copies = "" if jax.process_count() < 2 else "; --config.peer_copy_every=K would keep copies of it in host memory"
    _log(f"fault_tolerance=survive cannot protect this layout: {problem}{copies}; a lost process will end the "
         "run, and the same command resumes it from the last checkpoint.")
    return False
  return True


def _sample(layout, params, config, tokenizer) -> str:
  ids = generate(layout, params, encode_prompt(tokenizer, config.sample_prompt),
                 num_tokens=config.sample_tokens, temperature=SAMPLE_TEMPERATURE, seed=config.seed)
  return repr(config.sample_prompt + tokenizer.decode(ids[0]))


def _optional_figures(fetched: dict) -> dict:
  """float16's loss scale and a MoE model's router statistics as scalars; each expert's share of
  the choices gets its own key."""
  figures = {key: float(value) for key, value in fetched.items()
             if key.startswith("moe_") or key == "loss_scale"}
  if "expert_load" in fetched:
    figures.update({f"expert_load/{i}": float(share) for i, share in enumerate(fetched["expert_load"])})
  return figures


def _format(m: dict) -> str:
  mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
  skipped = f"  skipped {m['skipped']}" if m["skipped"] else ""
  scale = f"  loss_scale {m['loss_scale']:.0f}" if "loss_scale" in m else ""
  line = (f"step {m['step']:6d}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
          f"tokens/s {m['tokens_per_sec']:,.0f}  mfu {mfu}{skipped}{scale}")
  if "moe_balance_loss" in m:
    loads = [value for key, value in m.items() if key.startswith("expert_load/")]
    line += (f"  balance {m['moe_balance_loss']:.3f}  z {m['moe_z_loss']:.2f}  dropped {m['moe_dropped']:.1%}"
             f"  expert load {min(loads):.3f}..{max(loads):.3f}")
  return line


def _log(line: str) -> None:
  if jax.process_index() == 0:  # one console per run, however many hosts
    tqdm.write(line)  # above the progress bar, which stays at the bottom
