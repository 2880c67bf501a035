"""Orbax checkpoints: async saves, the last k kept, exact resume, and restore onto any mesh.

A checkpoint holds the whole train state (params, optimizer state, step, the
count of skipped non-finite updates), the config as JSON, a fingerprint of
each state leaf (training/fingerprint.py) that a restore checks the bytes
against, and the tokenizer its text went through, which a resume compares.
A LoRA run's holds its adapters and their moments but not the frozen weights,
which never change: a restore is given them (where the run started from) and
checks them against their saved fingerprints.
Data needs no iterator state: batch `s` is a pure function of (seed, s), and
the seed is in the config. Orbax writes each step into a temporary folder and
renames it when complete, so a run killed mid-save leaves the previous
checkpoint readable.
"""

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from input_pipeline.tokenizer import HfTokenizer
from training import lora, schedule_free
from training.fingerprint import fingerprints


FROZEN = "params"  # under LoRA, the weights that never change: left out of a checkpoint


class Checkpoints:
  """The checkpoints of one workdir."""

  def __init__(self, workdir: str, *, every: int, keep: int | None, tokenizer: dict | None = None,
               data: dict | None = None):
    """`keep` None keeps all (validate.py asks for >= 1). `tokenizer` (tokenizer_record) and `data`
    (data_record) are saved with each checkpoint; None saves none."""
    self.directory = Path(workdir).resolve() / "checkpoints"
    self.every = every
    self._tokenizer, self._data = tokenizer, data
    self._state_bytes = 0  # of the last state saved: what a failed save needed
    self._unchecked_save = False  # a save was started whose outcome `check` has not yet seen
    self._keep = keep
    logging.getLogger("absl").addFilter(_QUIET_FAILED_SAVES)  # orbax logs through absl
    # A failed save's serialization task, garbage-collected at any later time, even at exit.
    logging.getLogger("asyncio").addFilter(_QUIET_FAILED_SAVES)
    self._manager = self._open()

  def _open(self, multiprocessing: ocp.options.MultiprocessingOptions | None = None) -> ocp.CheckpointManager:
    """A manager whose saves line up the processes `multiprocessing` names at orbax's barriers (all by default)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self._keep, create=False, enable_async_checkpointing=True,
        multiprocessing_options=multiprocessing or ocp.options.MultiprocessingOptions())
    return ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler(),
                       "fingerprints": ocp.JsonCheckpointHandler(), "tokenizer": ocp.JsonCheckpointHandler(),
                       "data": ocp.JsonCheckpointHandler()})

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def _finished_steps(self) -> list[int]:
    """Steps whose save completed, read from disk. Orbax's own list counts a save from its start, so
    after a failed save it still names that step; a save in progress (or a failed one) is a temporary
    folder until orbax renames it to the step's number."""
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit()) if self.directory.is_dir() else []

  def set_aside_after(self, step: int) -> tuple[list[int], Path]:
    """Moves the checkpoints after `step` out of rotation; returns their steps and where they went."""
    later = [s for s in self.steps() if s > step]
    folder = self.directory.parent / "checkpoints_set_aside" / time.strftime("%Y%m%d-%H%M%S")
    for s in later:
      folder.mkdir(parents=True, exist_ok=True)
      (self.directory / str(s)).rename(folder / str(s))
    if later:
      self._manager.reload()
    return later, folder

  def resume_advice(self) -> str:
    """What a run that cannot go on tells its user to do, naming the checkpoint there is, if any."""
    good = self._finished_steps()
    if good:
      return f"run the same command again to resume from checkpoint step {good[-1]}"
    return "no checkpoint has been saved, so the same command run again starts over from step 0"

  def resume_before(self, step: int) -> str:
    """The flag that resumes from the newest checkpoint before `step`, for a refusal of `step`."""
    earlier = [s for s in self.steps() if s < step]
    return f"--config.resume={earlier[-1]}" if earlier else "another --config.workdir"

  def save(self, step: int, state, config, *, force: bool = False) -> None:
    """Start an async save when `step` is due (or forced); returns once the arrays are copied."""
    # The schedule is decided here, not by orbax, whose default also saves the first step.
    due = force or (self.every > 0 and step % self.every == 0)
    # A step already saved is kept: a run that rolls back redoes steps it may have saved, and their
    # redone state is the same (batch `s` is a pure function of (seed, s)).
    if not due or step in self._manager.all_steps():
      return
    self.directory.mkdir(parents=True, exist_ok=True)
    full, state = state, _kept(state)
    self._state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    # Orbax also raises an earlier async save's error here; the fingerprints of a state sharded over
    # processes are sums across them, which a lost process fails too. The frozen weights' are saved too: a
    # restore checks against them the weights it is given.
    with self._reporting_failed_saves():
      items = {"state": ocp.args.StandardSave(self._savable(state)), "config": ocp.args.JsonSave(config.to_dict()),
               "fingerprints": ocp.args.JsonSave(_named_fingerprints(full))}
      if self._tokenizer is not None:
        items["tokenizer"] = ocp.args.JsonSave(self._tokenizer)
      if self._data is not None:
        items["data"] = ocp.args.JsonSave(self._data)
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._unchecked_save = True

  def check(self) -> None:
    """Raises, in one line, if the last async save has failed (say, a full disk), from the first call
    after it ended. Orbax keeps a failure for the next save or wait to raise (check_for_errors misses
    it: the save's own finalize thread has taken it), so a run would go on until its next save. Between
    saves it does nothing: it is called after every step."""
    if self._unchecked_save and not self._manager.is_saving_in_progress():
      self._unchecked_save = False
      self.wait()  # returns at once after a save that succeeded

  @contextlib.contextmanager
  def _reporting_failed_saves(self):
    try:
      yield
    except Exception as error:  # orbax raises many kinds (OSError, ValueError, its own)
      free, needed = shutil.disk_usage(self.directory).free, self._state_bytes
      good = self._finished_steps()
      newest = f"The newest saved checkpoint is {f'step {good[-1]}' if good else 'none'}"
      resume = "resume" if good else "start over from step 0"  # never a promise of a checkpoint there is not
      if free < needed or _out_of_space(error):
        advice = (f"one needs about {needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free. {newest}: "
                  f"make room, then run the same command to {resume}.")
      elif _lost_process(error) and self._abandoned(_first_line(error), newest):
        return
      elif _lost_process(error):
        advice = (f"another process of the run was lost during the save ({free / 2**20:.0f} MiB are free: not a "
                  f"full disk). {newest}: run the same command to {resume}.")
      else:
        advice = (f"{free / 2**20:.0f} MiB are free: not a full disk. {newest}: put right what the error "
                  f"names, then run the same command to {resume}.")
      raise ValueError(f"saving a checkpoint into {self.directory} failed ({_first_line(error)}); {advice}") from None

  def _savable(self, state):
    """`state` as orbax is given it to save."""
    return state

  def _abandoned(self, failure: str, newest: str) -> bool:
    """Whether a save that a lost process broke (`failure`, in one line; `newest`: the newest checkpoint
    saved, in words) is abandoned while the run goes on: here never, and the run ends."""
    del failure, newest
    return False

  def save_now(self, step: int, state, config) -> None:
    """Save `step` whatever the schedule and wait until it is on disk (before stopping a run)."""
    self.save(step, state, config, force=True)
    self.wait()

  def restore(self, step: int, abstract_state, frozen=None):
    """The state at `step`, laid out by the shardings in `abstract_state` (any mesh), in the dtypes it
    was saved in: its fingerprints check the bytes on disk, so a dtype the config has changed since
    (precision.moments) is the caller's to apply, after that check (`cast_like`). A LoRA checkpoint's
    frozen weights are what `frozen()` gives (training/state.py's base_params), checked here."""
    # Orbax reads a state without its metadata file as no state at all, which would read as another model.
    folder = self.directory / str(step)
    lost = next((name for name in ("state", "state/_METADATA") if not (folder / name).exists()), None)
    if lost:
      raise ValueError(f"checkpoint step {step} in {self.directory} has lost {lost}, so it is damaged; it was "
                       f"left untouched: resume from an earlier one with {self.resume_before(step)}.")
    stored = self._read(step, lambda: self._manager.item_metadata(step)["state"])
    wanted = _on_disk(stored, abstract_state)
    _check_same_shapes(stored, wanted, f"checkpoint step {step} in {self.directory}")
    saved_dtypes = {name: leaf.dtype for name, leaf in _leaves_by_name(stored).items()}
    as_saved = jax.tree_util.tree_map_with_path(
        lambda path, want: jax.ShapeDtypeStruct(want.shape, saved_dtypes[_path_name(path)], sharding=want.sharding),
        wanted)
    state = self._read(step, lambda: self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(as_saved)))["state"])
    return state if wanted is abstract_state else self._with_frozen(step, state, frozen)

  def _with_frozen(self, step: int, restored: dict, frozen) -> dict:
    """`restored` (a LoRA checkpoint's entries) with the frozen weights `frozen()` gives, refused in one line
    unless they are the ones the adapters were trained on."""
    if frozen is None:
      raise ValueError(f"checkpoint step {step} in {self.directory} holds LoRA adapters without the frozen weights "
                       "they adapt, and this reader was given none; pass frozen=base_params (training/state.py).")
    params = frozen()
    changed = self.changed_leaf(step, {FROZEN: params})
    if changed:
      raise ValueError(f"checkpoint step {step} in {self.directory} holds LoRA adapters trained on other frozen "
                       f"weights than the ones given ({changed} differs from its fingerprint); start from the "
                       "init_from, seed and lora.frozen_dtype it was trained with.")
    return {**restored, FROZEN: params}

  def stored_config(self, step: int) -> dict:
    """The run config saved with `step`, as a plain dict."""
    return self._read(step, lambda: self._manager.restore(
        step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])

  def check_same_run(self, step: int, config) -> None:
    """Refuses, in one line, to resume `step` with another data source or optimizer than it was
    trained with: the steps after it would train on other text, or read a state that is not theirs.
    A checkpoint saved before the data record existed names no data: it passes."""
    if self._data is not None and (self.directory / str(step) / "data").is_dir():
      saved = self._read(step, lambda: self._manager.restore(
          step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"])
      if saved["identity"] != self._data["identity"]:
        raise ValueError(f"checkpoint step {step} in {self.directory} was trained on {saved['described']}, but "
                         f"this run reads {self._data['described']}; resume on the data it was trained on, or "
                         "train on this data in another --config.workdir.")
    was, now = self.stored_config(step)["optimizer"]["name"], config.optimizer.name
    if was != now:
      raise ValueError(f"checkpoint step {step} in {self.directory} holds {was}'s state, but this run's "
                       f"optimizer is {now}; resume with --config.optimizer.name={was}, or start {now} in "
                       "another --config.workdir (from these weights: tools/export.py, then "
                       "--config.init_from=hf:<its output>).")

  def check_tokenizer(self, step: int, data: str) -> None:
    """Refuses, in one line, to resume `step` on tokens of another tokenizer than the one it was trained
    on, which would mix the two in every later checkpoint; `data` names where this run's tokens come
    from. A checkpoint saved before the record existed (or trained on synthetic data) has none: it passes."""
    if self._tokenizer is None or not (self.directory / str(step) / "tokenizer").is_dir():
      return
    saved = self._read(step, lambda: self._manager.restore(
        step, args=ocp.args.Composite(tokenizer=ocp.args.JsonRestore()))["tokenizer"])
    if _identity(saved) != _identity(self._tokenizer):
      was, now = _described(saved), _described(self._tokenizer)
      if was == now:  # one name and size, another content: a tokenizer.json changed in place
        was, now = (f"{was} (sha256 {record.get('sha256', 'unrecorded')[:12]})" for record in (saved, self._tokenizer))
      raise ValueError(f"checkpoint step {step} in {self.directory} was trained on {was} tokens, but {data} "
                       f"holds {now} tokens, and resuming would mix the two; train on text prepared with "
                       f"--tokenizer={saved['name']} as it was, or on this data in another --config.workdir.")

  def restore_params(self, step: int, abstract_params):
    """Only the params of `step` (no optimizer state), laid out by the shardings in `abstract_params`."""
    return self.restore_weights(step, {"params": abstract_params})["params"]

  def restore_weights(self, step: int, abstract: dict, frozen=None) -> dict:
    """Only the entries of the state of `step` that `abstract` names (the params, LoRA's adapters: no optimizer
    state), laid out by its shardings; a LoRA checkpoint's frozen weights are what `frozen()` gives."""
    wanted = _on_disk(self._read(step, lambda: self._manager.item_metadata(step)["state"]), abstract)
    args = ocp.args.PyTreeRestore(item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted),
                                  partial_restore=True)
    weights = self._read(step, lambda: ocp.PyTreeCheckpointer().restore(self.directory / str(step) / "state",
                                                                         args=args))
    changed = self.changed_leaf(step, weights)
    if changed:
      raise ValueError(f"checkpoint step {step} in {self.directory} has changed since it was saved "
                       f"({changed} does not match its fingerprint); it was left untouched: use another step.")
    return weights if wanted is abstract else self._with_frozen(step, weights, frozen)

  def changed_leaf(self, step: int, restored) -> str | None:
    """The first leaf of `restored` (all or part of the state of `step`) whose fingerprint differs
    from the one saved with it, or None. A checkpoint saved before fingerprints existed has none to
    compare: it passes here, and only the finiteness check guards it."""
    if not (self.directory / str(step) / "fingerprints").is_dir():
      return None
    saved = self._read(step, lambda: self._manager.restore(
        step, args=ocp.args.Composite(fingerprints=ocp.args.JsonRestore()))["fingerprints"])
    now = _named_fingerprints(restored)
    return next((name for name in _weights_first(now) if saved.get(name) != now[name]), None)

  def _read(self, step: int, read):
    try:
      return read()
    except Exception as error:  # orbax raises many kinds; all mean the same to the user
      raise ValueError(f"checkpoint step {step} in {self.directory} cannot be read "
                       f"({_first_line(error)}); it was left untouched.") from None

  def wait(self) -> None:
    with self._reporting_failed_saves():
      self._manager.wait_until_finished()

  def close(self) -> None:
    try:
      with self._reporting_failed_saves():  # closing waits for the last async save, which may fail
        if self._manager is not None:  # None: opened later by a subclass, and not yet
          self._manager.close()
    finally:
      logging.getLogger("absl").removeFilter(_QUIET_FAILED_SAVES)


class _QuietFailedSaves(logging.Filter):
  """Drops orbax's own reports of a failed async save, a traceback each from several threads
  (over 300 lines for a full disk): `_reporting_failed_saves` reports the failure in one line."""

  _REPORTS = ("_SignalingThread.run() raised an exception", "Handler Commit operations or the Commit callback",
              "Save Finalize thread")

  def filter(self, record: logging.LogRecord) -> bool:
    orbax_report = "/orbax/" in record.pathname and any(report in record.getMessage() for report in self._REPORTS)
    # asyncio's "Task exception was never retrieved" for a save's serialization task.
    lost_save_task = record.name == "asyncio" and "serialize" in record.getMessage()
    return not (record.levelno >= logging.ERROR and (orbax_report or lost_save_task))


_QUIET_FAILED_SAVES = _QuietFailedSaves()


def data_record(source: str, split) -> dict:
  """What a checkpoint keeps of the text it was trained on (data.source and its train split): a token
  folder is known by its training tokens' count, wherever it lies (as a tokenizer by its content), the
  built-in corpus by its name (its size follows the Python version that built it)."""
  if source == "builtin":
    return {"identity": ["builtin"], "described": "the built-in corpus"}
  return {"identity": ["tokens", len(split.tokens)],
          "described": f"the token folder {split.origin} ({len(split.tokens):,} training tokens)"}


def tokenizer_record(tokenizer) -> dict:
  """What a checkpoint keeps of the tokenizer its text went through: its name and vocabulary size, and
  for a Hugging Face tokenizer a hash of its content, since the same tokenizer may lie in another
  directory (HfTokenizer.same_as compares the same text)."""
  record = {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size}
  if isinstance(tokenizer, HfTokenizer):
    record["sha256"] = hashlib.sha256(tokenizer.content().encode()).hexdigest()
  return record


def _described(record: dict) -> str:
  return f"{record['name']} (vocab {record['vocab_size']})"


def _identity(record: dict) -> tuple:
  """A Hugging Face tokenizer is its content, wherever it lies; the others are their names."""
  return record.get("sha256", record["name"]), record["vocab_size"]


def _check_same_shapes(stored, abstract_state, where: str) -> None:
  """Refuse a checkpoint of another model shape, naming the first leaf that differs."""
  stored_leaves, wanted_leaves = _leaves_by_name(stored), _leaves_by_name(abstract_state)
  if stored_leaves.keys() != wanted_leaves.keys():
    extra = sorted(stored_leaves.keys() - wanted_leaves.keys())
    missing = sorted(wanted_leaves.keys() - stored_leaves.keys())
    if all(name.startswith("loss_scale/") for name in extra + missing):  # the model is the same
      raise ValueError(f"{where} was saved {'with' if extra else 'without'} float16's loss scale, and this "
                       f"config runs {'without' if extra else 'with'} one; resume with the precision.compute "
                       f"it was written with{' (float16)' if extra else ''} or choose another workdir.")
    if schedule_free.held_a_first_moment(extra, missing):
      raise ValueError(_written_with_a_first_moment(where, extra))
    held = "a different model" if any(name.startswith("params/") for name in extra + missing) else \
        "another optimizer's state (an optimizer.* setting differs)"
    raise ValueError(f"{where} holds {held} (missing {missing[:3]}, unexpected "
                     f"{extra[:3]}); use the config it was written with or another workdir.")
  for name in _weights_first(wanted_leaves):
    wanted = wanted_leaves[name]
    if tuple(stored_leaves[name].shape) != tuple(wanted.shape):
      raise ValueError(f"{where} holds {name} with shape {tuple(stored_leaves[name].shape)}, but "
                       f"this config needs {tuple(wanted.shape)}; use the config it was written "
                       "with or another workdir.")


def _written_with_a_first_moment(where: str, extra: list[str]) -> str:
  """The refusal of a schedule-free checkpoint written before c25a3c0. Only its weights can still be read
  (tools/export.py reads the params alone): a resume restores the whole state, and so does branch_from."""
  moment = extra[0][:extra[0].index(schedule_free.FIRST_MOMENT) + len(schedule_free.FIRST_MOMENT)]
  return (f"{where} holds schedule-free AdamW's state as written before commit c25a3c0 dropped its first moment "
          f"(its {len(extra)} leaves under {moment}, always zero), which this code's state of z and v cannot "
          "restore; resume it with a checkout from before c25a3c0 (git checkout c25a3c0~1), or export its "
          "weights with tools/export.py and start from them with --config.init_from=hf:<that directory> in "
          "another --config.workdir.")


def _on_disk(stored, abstract: dict) -> dict:
  """The entries of `abstract` that a checkpoint whose state is `stored` (its metadata) holds: all but a LoRA run's
  frozen weights (the params), which a checkpoint written since they were left out lacks."""
  if FROZEN in stored or FROZEN not in abstract:
    return abstract
  return {k: v for k, v in abstract.items() if k != FROZEN}


def _kept(state: dict) -> dict:
  """What a checkpoint holds of `state`: all of it, but a LoRA run's frozen weights (the params beside adapters)."""
  return {k: v for k, v in state.items() if k != FROZEN} if lora.ADAPTERS in state else state


def _weights_first(names) -> list[str]:
  """Leaf names with the params first: the leaf a user recognises is the one to name."""
  return sorted(names, key=lambda n: not n.startswith("params"))


def _named_fingerprints(state) -> dict[str, int]:
  return {name: int(value) for name, value in _leaves_by_name(jax.device_get(fingerprints(state))).items()}


def cast_like(state, abstract_state):
  """`state` in the dtypes of `abstract_state`, each leaf left where it is; leaves already so, untouched."""
  return jax.tree.map(lambda leaf, want: leaf if leaf.dtype == want.dtype else leaf.astype(want.dtype),
                      state, abstract_state)


def _leaves_by_name(tree) -> dict:
  """Leaves keyed by a path string that reads the same for a namedtuple and the dict orbax stores."""
  return {_path_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _out_of_space(error: Exception) -> bool:
  """ENOSPC, as an OSError or in the text of tensorstore's errors, which orbax passes on as ValueErrors."""
  return getattr(error, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(error)


def _lost_process(error: Exception) -> bool:
  """Whether a save of a multi-process run failed in a collective or barrier between its processes
  (a JaxRuntimeError, which orbax may wrap): one of them has gone, or stopped answering."""
  chain = []
  while error is not None and error not in chain:
    chain.append(error)
    error = error.__cause__ or error.__context__
  return jax.process_count() > 1 and any(isinstance(e, jax.errors.JaxRuntimeError) for e in chain)


def _first_line(error: Exception) -> str:
  text = str(error).strip().splitlines()
  first = text[0].split(" See full TensorStore details")[0] if text else ""  # the rest is a pybind repr
  return f"{type(error).__name__}: {first}"[:200]
