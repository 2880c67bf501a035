"""The training loop: plan the layout, resume or initialise, then log, evaluate, save and stop around
the steps a stepper takes (training/stepper.py: on the mesh as planned, or as resilience/fault_tolerance.py
chooses)."""

import contextlib
import functools
import time

import jax
from tqdm import tqdm

from configs.load import with_fields
from input_pipeline import data
from input_pipeline.tokenizer import run_tokenizer
from interop import hf_checkpoint
from measure import goodput
from measure.dry_run import report
from measure.goodput import Ledger, steps_logged
from measure.profiling import parse_steps
from parallel import distributed
from resilience.fault_tolerance import FaultTolerance
from resilience.preemption import StopRequests
from resilience.workdir_lock import WorkdirLock
from run.console import log, optional_figures, step_line
from run.local_stepper import LocalStepper
from run.nonfinite import NonfiniteUpdates
from run.resume import open_branch, start_state
from run.rollout_stepper import RolloutStepper
from training import curriculum, metrics
from training.checkpoint import Checkpoints, data_record, tokenizer_record
from training.sample import check_request, encode_prompt, generate
from training.state import active_param_count, param_count, plan, trained_count
from training.step import model_weights
from training.stepper import Stepper, eval_due
from training.validate import check_run

SAMPLE_TEMPERATURE = 0.8  # the closing sample's; sample.py takes any


def train(config, dry_run: bool = False) -> dict:
  """Train per `config`; returns the last logged metrics (and the final eval loss, if any)."""
  ledger = Ledger(done_before=steps_logged(config.workdir))  # what this start does again was done before
  distributed.initialize(config.distributed, survive=config.fault_tolerance == "survive")
  pretrained = hf_checkpoint.open_init_from(config.init_from)
  if pretrained is not None:  # the checkpoint decides the model's shape
    config = with_fields(config, pretrained.model_fields(config))
  check_run(config)
  if config.objective == "grpo":  # its batches are sampled for grpo.prompts: no token data is read
    config = with_fields(config, {"data.source": "synthetic"})
  distributed.check_same_config(config)
  train_split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  val_split = data.open_split(config.data, "val", vocab_size=config.model.vocab_size)
  # An imported checkpoint's own tokenizer wins; token data another tokenizer wrote is refused here.
  text_tokenizer = run_tokenizer(config.init_from, train_split.tokenizer, train_split.origin)
  if config.data.segments:  # packed documents end at the tokenizer's end-of-text, which the token files hold
    config = with_fields(config, {"model.document_end": text_tokenizer.end_of_text})
  layout = plan(config)  # refuses a bad mesh or model before anything compiles
  _check_before_compiling(config, layout, train_split, val_split, text_tokenizer)
  if dry_run:
    text = report(layout, config, weighted=train_split.mask is not None)
    log(text)
    return {"report": text}
  tolerance = FaultTolerance(config, layout, log)
  # Synthetic data carries no text: its checkpoints record no tokenizer, and resume on any.
  synthetic = train_split.origin == "synthetic"
  branch = open_branch(config.branch_from, config.workdir)
  checkpoints = tolerance.checkpoints(config.workdir, every=config.checkpoint.every, keep=config.checkpoint.keep,
                                      tokenizer=None if synthetic else tokenizer_record(text_tokenizer),
                                      data=None if synthetic else data_record(config.data.source, train_split))
  lock = WorkdirLock(config.workdir) if jax.process_index() == 0 else contextlib.nullcontext()
  try:
    # Signals are recorded from here on, so a SIGTERM while compiling still ends the run cleanly.
    with StopRequests() as stop, lock:
      start, state = (None, None) if tolerance.brings_state else start_state(
          config, layout, checkpoints, branch, pretrained, ledger, train_split.origin)
      if start == config.steps:  # restored all the same, so a checkpoint of another model is refused
        log(f"step {start} is the last of steps={config.steps}: nothing to train; raise --config.steps "
            "to train on.")
        last = {}
      else:
        with ledger.timing("compile"):  # both steppers compile their steps ahead
          local = LocalStepper if layout.grpo is None else functools.partial(RolloutStepper, tokenizer=text_tokenizer)
          stepper = tolerance.stepper(local, config, layout, state, train_split, val_split, stop, checkpoints)
        ledger.add("startup", ledger.unaccounted())  # everything before the first step but the above
        last = _run(config, stepper, checkpoints, stop, text_tokenizer, ledger)
  finally:
    checkpoints.close()
    if branch[0] is not None:
      branch[0].close()
  tolerance.leave()
  return last


def _check_before_compiling(config, layout, train_split, val_split, text_tokenizer) -> None:
  """Refuses token splits shorter than a sequence, a closing sample the model cannot take and a bad
  profiling window: here, not after compiling."""
  if layout.preference is not None and train_split.pairs is None:
    raise ValueError(f"objective=dpo trains on preference pairs, which {train_split.origin} does not hold; prepare "
                     "them with tools/prepare.py --chosen_field=... --rejected_field=....")
  if layout.preference is None and train_split.pairs is not None:
    raise ValueError(f"{train_split.origin} holds preference pairs, which objective={config.objective!r} does not "
                     "train on; add --config.objective=dpo.")
  data.check_long_enough(train_split, layout.model.max_len)
  for phase in curriculum.phases(config)[:-1]:  # the mesh and model refuse a phase's batch or window here
    plan(phase.config)
  if config.eval_every:
    data.check_long_enough(val_split, layout.model.max_len)
  if config.sample_tokens:
    prompt = encode_prompt(text_tokenizer, config.sample_prompt)
    check_request(layout.model.max_len, len(prompt), config.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                  top_k=0, vocab_size=layout.model.vocab_size)
  parse_steps(config.profile_steps, config.steps)


def _run(config, stepper: Stepper, checkpoints: Checkpoints, stop: StopRequests, text_tokenizer,
         ledger: Ledger) -> dict:
  """Trains with `stepper` from its state to config.steps: logs, evaluates, saves and stops; `ledger`
  gets the time of each, and is written with each log step and told at the end."""
  state, layout = stepper.state, stepper.layout
  start = int(state["step"])
  if stop.signal_name and jax.process_count() == 1:  # several processes agree at the first log step
    log(f"stopped by {stop.signal_name} before step {start + 1}; nothing new to save.")
    return {}
  writer = metrics.MetricsWriter(config.workdir, after_step=start, config=config)
  active = "" if not layout.model.num_experts else f" ({active_param_count(layout):,} active per token)"
  adapters = "" if not layout.lora else (f" through {trained_count(layout):,} adapter parameters of rank "
                                         f"{layout.lora.rank} (the rest frozen)")
  log(f"training {param_count(layout):,} parameters{active}{adapters} on {layout.mesh.size} devices, "
      f"mesh {dict(layout.mesh.shape)}, steps {start}..{config.steps}, writing to {config.workdir}")
  if config.curriculum:
    log(curriculum.describe(curriculum.phases(config)))
  last, done, speed = {}, start, _Speed(config, layout, start)
  nonfinite = NonfiniteUpdates(config.nonfinite, start, int(jax.device_get(state["skipped"])))
  with stepper, writer, tqdm(initial=start, total=config.steps, disable=jax.process_index() != 0,
                             leave=False) as bar:
    for finished in stepper.steps():
      if finished.step <= done:  # a run that rolled back (to a peer copy) redoes the steps since
        writer.rewind(finished.step - 1)
        speed.rewound(finished.step - 1)
      done, state = finished.step, finished.state
      ledger.add("data_wait", finished.data_seconds)
      ledger.add("generation", finished.generation_seconds)
      ledger.add("evaluation", finished.eval_seconds)
      bar.update(done - bar.n)
      for event in finished.events:
        writer.write(done, event.record())
        ledger.lost_process(event.record())
        log(event.line())
      if done % config.log_every == 0 or done == config.steps:
        last = _log_step(config, finished, stepper.peak_bytes, speed, writer, ledger)
        refusal = nonfinite.refusal(done, last["skipped"])
        if refusal:
          stepper.guarded(lambda: checkpoints.save_now(done, state, config))  # skipped steps left it good
          raise ValueError(refusal)
      if eval_due(config, done):
        name = stepper.eval_metric  # eval_loss, or eval_reward under objective=grpo
        with ledger.timing("evaluation"):
          last[name] = stepper.evaluate(finished)
        writer.write(done, {name: last[name]})
        log(f"step {done:6d}  {name.replace('_', ' ')} {last[name]:.4f}")
      ledger.step(done)  # before the save: a save that a lost process broke is the next step's to tell
      _save(config, stepper, checkpoints, done, state, ledger)
      if finished.stop:
        with ledger.timing("checkpoint_save"):
          stepper.guarded(lambda: checkpoints.save_now(done, state, config))
        log(f"stopped by {stop.signal_name} after step {done}; saved a checkpoint there, "
            "run the same command to resume.")
        break
    else:
      with ledger.timing("checkpoint_save"):
        checkpoints.wait()
      if config.sample_tokens:
        log("sample: " + _sample(stepper.layout, model_weights(stepper.layout, state), config, text_tokenizer))
    record = ledger.write(config.workdir, done) if writer.active else ledger.record()
  log("where the wall time went:\n" + goodput.table({"this run": goodput.attempt_totals(record)}))
  return last


class _Speed:
  """Tokens per second and MFU over the steps since the last log step; steps redone after a roll back
  count in the interval that redoes them, with the recovery's time."""

  def __init__(self, config, layout, start: int):
    # A preference pair is two sequences, its prompt with each answer; a curriculum's phases read fewer.
    pair = 1 if layout.preference is None else 2
    phases = curriculum.phases(config)
    self._tokens_through = lambda step: pair * curriculum.summed(phases, step, curriculum.tokens)
    self._flops_per_token = metrics.flops_per_token(layout.model, active_param_count(layout))
    self._peak = metrics.peak_flops_per_device(config.peak_tflops)
    self.restart(start)

  def restart(self, step: int) -> None:
    self._since, self._from = time.perf_counter(), step

  def rewound(self, step: int) -> None:
    self._from = min(self._from, step)

  def figures(self, done: int) -> dict:
    tokens = self._tokens_through(done) - self._tokens_through(self._from)
    tokens_per_sec = tokens / (time.perf_counter() - self._since)
    return {"tokens_per_sec": tokens_per_sec, "mfu": metrics.mfu(tokens_per_sec, self._flops_per_token, self._peak)}


def _log_step(config, finished, peak_bytes: int, speed: _Speed, writer, ledger: Ledger) -> dict:
  """A log step's figures, written to the metrics (and process 0's ledger) and the console."""
  done, fetched = finished.step, jax.device_get(finished.metrics)
  last = {"step": done, "loss": float(fetched["loss"]), "lr": float(fetched["lr"]),
          "grad_norm": float(fetched["grad_norm"]), **speed.figures(done),
          "skipped": int(fetched["skipped"]), "peak_bytes": peak_bytes, **optional_figures(fetched)}
  writer.write(done, {k: v for k, v in last.items() if k != "step"})
  if writer.active:  # process 0, as for metrics.jsonl
    ledger.write(config.workdir, done)
  log(step_line(last))
  speed.restart(done)
  return last


def _save(config, stepper: Stepper, checkpoints: Checkpoints, done: int, state, ledger: Ledger) -> None:
  """Saves step `done` where due. A stepper that outlives lost processes saves in a protected block: a
  process lost during a save abandons the save, and the next step recovers from the loss."""
  saving = time.perf_counter()
  saved = stepper.guarded(lambda: checkpoints.save(done, state, config, force=done == config.steps))
  checkpoints.check()  # a failed async save (a full disk) stops the run now, not at the next save
  if saved:  # else the time went to finding the loss, which the next step's event tells the ledger
    ledger.add("checkpoint_save", time.perf_counter() - saving)
  else:
    log(f"step {done:6d}  a process was lost while saving: the save was abandoned, the checkpoints "
        "saved before it stay readable, and the next step recovers from the loss")


def _sample(layout, params, config, tokenizer) -> str:
  ids = generate(layout, params, encode_prompt(tokenizer, config.sample_prompt),
                 num_tokens=config.sample_tokens, temperature=SAMPLE_TEMPERATURE, seed=config.seed)
  return repr(config.sample_prompt + tokenizer.decode(ids[0]))
