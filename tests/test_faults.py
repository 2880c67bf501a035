"""Faults never cost saved work: bad checkpoints are refused, non-finite steps never land, signals save."""

import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import ROOT, batch_at, fresh_state, logged_steps, read_metrics, tiny_config, wait_for
from input_pipeline import data
from input_pipeline.token_files import write_token_folder
from run.loop import train
from training.checkpoint import Checkpoints
from training.state import abstract_inputs, plan
from training.step import compile_train_step, make_train_step


def config_for(workdir, **overrides):
  """10 steps on data=8, logged and checkpointed every 5 (test_checkpoint's: 20 steps, logged every step,
  checkpointed every 10)."""
  return tiny_config(**{"steps": 10, "log_every": 5, "eval_every": 0, "sample_tokens": 0,
                        "checkpoint.every": 5, "mesh.data": 8, "workdir": str(workdir), **overrides})


def snapshot(folder):
  return {p: os.path.getsize(p) for p in map(str, folder.rglob("*")) if os.path.isfile(p)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("trained")
  train(config_for(workdir))
  return workdir


def test_resume_never_refuses_to_write_over_checkpoints(trained):
  with pytest.raises(ValueError, match="up to step 10 and resume=never"):
    train(config_for(trained, resume="never"))


def test_resume_from_a_missing_step_is_refused(trained):
  with pytest.raises(ValueError, match=r"resume='7' names no checkpoint .* \[5, 10\]"):
    train(config_for(trained, resume="7"))


def test_a_different_model_is_refused_by_name(trained):
  before = snapshot(trained)
  with pytest.raises(ValueError, match=r"checkpoint step 10 .* holds params/blocks/mlp/\w+_kernel with shape"):
    train(config_for(trained, **{"steps": 20, "model.mlp_dim": 128}))
  assert snapshot(trained) == before


def test_a_corrupt_checkpoint_is_refused_and_kept(tmp_path):
  train(config_for(tmp_path))
  for path in (tmp_path / "checkpoints" / "10" / "state").rglob("*"):
    if path.is_file() and path.parent.name == "d":
      path.write_bytes(b"not a checkpoint")
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match="checkpoint step 10 .* cannot be read"):
    train(config_for(tmp_path, steps=20))
  assert snapshot(tmp_path) == before


def test_a_checkpoint_that_lost_its_metadata_file_is_refused_as_damaged(trained, tmp_path):
  # Orbax reads the state as none at all without it, which read as "a different model".
  shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
  (tmp_path / "checkpoints" / "10" / "state" / "_METADATA").unlink()
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match=rf"^checkpoint step 10 in {tmp_path}/checkpoints has lost state/_METADATA, so "
                                       r"it is damaged; it was left untouched: resume from an earlier one with "
                                       r"--config.resume=5\.$"):
    train(config_for(tmp_path, steps=20))
  assert snapshot(tmp_path) == before


def test_a_damaged_checkpoint_is_refused_and_resuming_before_it_sets_it_aside(tmp_path):
  config = config_for(tmp_path)
  train(config)
  checkpoints = Checkpoints(str(tmp_path), every=5, keep=3)
  state = checkpoints.restore(10, abstract_inputs(plan(config), config)[0])
  state["params"]["ln_final"]["scale"] = state["params"]["ln_final"]["scale"] * np.nan
  checkpoints.save_now(15, state, config)  # what bit rot in a data file restores to
  checkpoints.close()
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match=r"^checkpoint step 15 .* non-finite .* --config.resume=10\.$"):
    train(config_for(tmp_path, steps=20))
  assert snapshot(tmp_path) == before
  # Resuming from 10 moves 15 out of rotation (kept), so the new 15 and 20 are this run's own.
  train(config_for(tmp_path, steps=20, resume="10"))
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "15", "20"]
  assert [p.name for p in (tmp_path / "checkpoints_set_aside").glob("*/*")] == ["15"]


def test_a_checkpoint_damaged_into_finite_values_is_refused_by_its_fingerprint(trained, tmp_path):
  shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
  config = config_for(tmp_path)
  checkpoints = Checkpoints(str(tmp_path), every=5, keep=3)
  state = checkpoints.restore(10, abstract_inputs(plan(config), config)[0])
  checkpoints.close()
  # Change one stored float by one ulp, still finite. The bytes on disk are tensorstore's encoding
  # (compressed where that pays), so the value is rewritten through orbax into a copy of the state,
  # and the copy's stored arrays replace step 10's, which keeps the fingerprints taken at the save.
  positions = state["params"]["embed"]["positions"]
  nudged = positions.at[-1, 0].set(np.nextafter(positions[-1, 0], np.float32(1)))
  state["params"]["embed"]["positions"] = nudged
  elsewhere = Checkpoints(str(tmp_path / "elsewhere"), every=5, keep=3)
  elsewhere.save(10, state, config, force=True)
  elsewhere.close()
  shutil.rmtree(tmp_path / "checkpoints" / "10" / "state")
  shutil.copytree(tmp_path / "elsewhere" / "checkpoints" / "10" / "state", tmp_path / "checkpoints" / "10" / "state")
  shutil.rmtree(tmp_path / "elsewhere")
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match=r"^checkpoint step 10 .* has changed since it was saved \(params/embed/"
                                       r"positions does not match its fingerprint\), so it is damaged; .* "
                                       r"--config.resume=5\.$"):
    train(config_for(tmp_path, steps=20))
  checkpoints = Checkpoints(str(tmp_path), every=5, keep=3)
  with pytest.raises(ValueError, match=r"^checkpoint step 10 .* \(params/embed/positions does not match its "
                                       r"fingerprint\); it was left untouched: use another step\.$"):
    checkpoints.restore_params(10, abstract_inputs(plan(config), config)[0]["params"])  # sample.py's, export's
  checkpoints.close()
  assert snapshot(tmp_path) == before


def test_a_checkpoint_saved_before_fingerprints_restores_on_its_finiteness_alone(trained, tmp_path):
  shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
  shutil.rmtree(tmp_path / "checkpoints" / "10" / "fingerprints")  # as written before they existed
  config = config_for(tmp_path)
  checkpoints = Checkpoints(str(tmp_path), every=5, keep=3)
  state = checkpoints.restore(10, abstract_inputs(plan(config), config)[0])
  assert checkpoints.changed_leaf(10, state) is None
  assert checkpoints.changed_leaf(5, state) == "params/blocks/attn/out_bias"  # those of 5 are there
  checkpoints.close()


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
  """A Hugging Face tokenizer of 5 words, which fits the byte-sized model's vocabulary."""
  tokenizers = pytest.importorskip("tokenizers")
  folder = tmp_path_factory.mktemp("words")
  words = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {word: i for i, word in enumerate(["<|endoftext|>", "[UNK]", "the", "mesh", "trains"])}, unk_token="[UNK]"))
  words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  words.save(str(folder / "tokenizer.json"))
  return folder


def word_tokens(folder, tokenizer_dir):
  """A token folder as tools/prepare.py --tokenizer=hf:DIR writes it, of random words."""
  ids = np.random.default_rng(0).integers(0, 5, 4096)
  write_token_folder(folder, [ids], tokenizer=f"hf:{tokenizer_dir.resolve()}", vocab_size=5, val_fraction=0.1)
  return {"data.source": "tokens", "data.path": str(folder)}


def test_resuming_on_another_data_source_is_refused_before_its_step_is_measured(trained, word_tokenizer, tmp_path):
  # The built-in corpus's run at its last step, resumed on a token folder: once "nothing to train", rc 0.
  shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
  words = word_tokens(tmp_path.parent / f"{tmp_path.name}-tokens", word_tokenizer)
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match=(
      rf"^checkpoint step 10 in {tmp_path}/checkpoints was trained on the built-in corpus, but this run reads "
      rf"the token folder {words['data.path']} \(3,686 training tokens\); resume on the data it was trained on, "
      r"or train on this data in another --config.workdir\.$")):
    train(config_for(tmp_path, **words))
  assert snapshot(tmp_path) == before


def test_resuming_with_another_optimizer_names_both(trained, tmp_path):
  shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match=(
      rf"^checkpoint step 10 in {tmp_path}/checkpoints holds adamw's state, but this run's optimizer is sgd; "
      r"resume with --config.optimizer.name=adamw, or start sgd in another --config.workdir")):
    train(config_for(tmp_path, steps=15, **{"optimizer.name": "sgd"}))
  assert snapshot(tmp_path) == before


def test_a_tokenizer_is_known_by_its_content_and_a_checkpoint_without_a_record_by_nothing(word_tokenizer, tmp_path):
  train(config_for(tmp_path / "run", steps=5, **word_tokens(tmp_path / "tokens", word_tokenizer)))
  # The same tokens and tokenizer.json in other directories are the same data and tokenizer.
  shutil.copytree(word_tokenizer, tmp_path / "copy")
  copy = word_tokens(tmp_path / "tokens-copy", tmp_path / "copy")
  assert train(config_for(tmp_path / "run", steps=10, **copy))["step"] == 10
  # Its tokenizer.json rewritten in place, another vocabulary of the same size: the message says what changed.
  swapped = json.loads((tmp_path / "copy" / "tokenizer.json").read_text())
  vocab = swapped["model"]["vocab"]
  vocab["the"], vocab["mesh"] = vocab["mesh"], vocab["the"]
  (tmp_path / "copy" / "tokenizer.json").write_text(json.dumps(swapped))
  with pytest.raises(ValueError, match=(
      rf"^checkpoint step 10 .* was trained on hf:{tmp_path}/copy \(vocab 5\) \(sha256 [0-9a-f]{{12}}\) tokens, but "
      rf".* holds hf:{tmp_path}/copy \(vocab 5\) \(sha256 [0-9a-f]{{12}}\) tokens, and resuming would mix the two")):
    train(config_for(tmp_path / "run", steps=15, **copy))
  # Checkpoints saved before the records existed name no tokenizer and no data, and resume on any.
  for record in [*(tmp_path / "run" / "checkpoints").glob("*/tokenizer"), *(tmp_path / "run" / "checkpoints").glob("*/data")]:
    shutil.rmtree(record)
  assert train(config_for(tmp_path / "run", steps=15))["step"] == 15


def test_a_second_run_in_a_workdir_is_refused_and_a_killed_runs_lock_taken_over(tmp_path):
  hold = "import sys, time; from resilience.workdir_lock import WorkdirLock\n" \
         "with WorkdirLock(sys.argv[1]):\n  print('held', flush=True); time.sleep(600)"
  holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline() == "held\n"
  with pytest.raises(ValueError, match=rf"^{tmp_path} is in use by the run of pid {holder.pid} on "):
    train(config_for(tmp_path, steps=2))
  assert not (tmp_path / "checkpoints").exists()
  holder.kill()  # SIGKILL: the lock file stays behind, naming a process that is gone
  holder.wait()
  assert train(config_for(tmp_path, steps=2))["step"] == 2
  assert not (tmp_path / "run.lock").exists()


def test_a_run_that_skips_most_updates_stops_and_says_so(tmp_path):
  # A learning rate of 1e9 blows the weights up after one step; the next losses are not finite.
  with pytest.raises(ValueError, match=r"^step 5: 4 of the last 5 updates .* not applied; the last good "
                                       r"state is saved as step 5\. More than half were skipped"):
    train(config_for(tmp_path, **{"optimizer.lr": 1e9, "schedule.warmup_steps": 0, "optimizer.clip_norm": 0.0}))
  assert "5" in os.listdir(tmp_path / "checkpoints")


def test_a_step_whose_update_alone_is_not_finite_is_skipped():
  # A NaN learning rate (refused up front, but any NaN in the update rule does the same) leaves
  # loss and gradient finite and only the update NaN, which once reached the weights and the checkpoint.
  config = config_for("unused", **{"optimizer.lr": float("nan"), "mesh.data": 1})
  layout = plan(config, jax.devices()[:1])
  state = fresh_state(layout, config.seed)
  before = jax.device_get(state)
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=0, step=0, batch_size=config.batch_size,
                            seq_len=config.model.max_len, sharding=layout.batch_sharding)
  state, metrics = make_train_step(layout, config)(state, batch)
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert int(metrics["skipped"]) == 1
  for after, was in zip(jax.tree.leaves(jax.device_get((state["params"], state["opt_state"]))),
                        jax.tree.leaves((before["params"], before["opt_state"]))):
    np.testing.assert_array_equal(after, was)


def test_nonfinite_stop_saves_the_last_good_state(tmp_path):
  # 1e9 blows the weights up so that a later loss is not finite.
  config = config_for(tmp_path, **{"optimizer.lr": 1e9, "schedule.warmup_steps": 0,
                                   "optimizer.clip_norm": 0.0, "nonfinite": "stop"})
  with pytest.raises(ValueError, match="non-finite loss, gradient or update .* last good state is saved"):
    train(config)
  checkpoints = Checkpoints(str(tmp_path), every=5, keep=3)
  state = checkpoints.restore(checkpoints.steps()[-1], abstract_inputs(plan(config), config)[0])
  checkpoints.close()
  floats = [x for x in jax.tree.leaves((state["params"], state["opt_state"])) if x.dtype.kind == "f"]
  assert all(np.isfinite(np.asarray(x)).all() for x in floats)
  for line in (tmp_path / "metrics.jsonl").read_text().splitlines():  # strict JSON: no bare NaN
    json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl: {line}"))


def test_a_fresh_start_trims_old_records_and_a_torn_last_line(tmp_path):
  # What a run killed before its first checkpoint leaves: records past step 0, the last one torn.
  records = [json.dumps({"step": step, "loss": 5.0}) for step in range(1, 13)]
  (tmp_path / "metrics.jsonl").write_text("\n".join(records) + '\n{"step": 13, "lo')
  train(config_for(tmp_path, **{"steps": 2, "log_every": 1}))
  logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert logged == [1, 2]


def test_keep_below_one_is_refused_before_anything_is_written(tmp_path):
  train(config_for(tmp_path, steps=5))
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match=r"^checkpoint.keep=0 must be an integer of at least 1: .* delete them all"):
    train(config_for(tmp_path, **{"steps": 10, "checkpoint.keep": 0}))
  assert snapshot(tmp_path) == before


def start_train(workdir, *flags):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
             "--xla_backend_optimization_level=0")
  return subprocess.Popen(
      [sys.executable, "train.py", "--config.steps=400", "--config.log_every=5",
       "--config.eval_every=0", "--config.sample_tokens=0", "--config.checkpoint.every=10",
       "--config.schedule.decay=constant",
       "--config.model.num_layers=1", f"--config.workdir={workdir}", *flags],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path):
  process = start_train(tmp_path)
  wait_for(lambda: logged_steps(tmp_path))
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=120)
  assert process.returncode == 0, err
  stopped_at = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
  assert str(stopped_at) in os.listdir(tmp_path / "checkpoints")


def test_sigterm_while_starting_up_exits_zero_without_a_step(tmp_path):
  process = start_train(tmp_path)
  wait_for(lambda: (tmp_path / "run.lock").exists())  # taken once signals are being recorded
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=120)
  assert process.returncode == 0, err
  assert "stopped by SIGTERM before step 1; nothing new to save." in out
  assert not (tmp_path / "run.lock").exists()


def test_sigkill_loses_only_the_steps_since_the_last_checkpoint(tmp_path):
  process = start_train(tmp_path)
  wait_for(lambda: (tmp_path / "checkpoints" / "10").is_dir() and max(logged_steps(tmp_path), default=0) >= 15)
  process.kill()
  process.wait()
  saved = sorted(int(name) for name in os.listdir(tmp_path / "checkpoints") if name.isdigit())
  losses_before = {r["step"]: r["loss"] for r in read_metrics(tmp_path)}
  process = start_train(tmp_path, "--config.steps=30")
  out, err = process.communicate(timeout=300)
  assert process.returncode == 0, err
  assert f"resuming from step {saved[-1]}" in out
  steps = logged_steps(tmp_path)
  assert steps == sorted(set(steps)) and steps[-1] == 30  # the curve continues, no repeats
  losses_after = {r["step"]: r["loss"] for r in read_metrics(tmp_path)}
  # Steps after the checkpoint were lost and recomputed, to the same bits.
  assert all(losses_after[s] == losses_before[s] for s in losses_before if s <= 30)


SHORT_RUN = ("--config.steps=24", "--config.log_every=1", "--config.checkpoint.every=4", "--config.batch_size=8",
             "--config.model.max_len=32")


@pytest.fixture(scope="module")
def short_reference(tmp_path_factory):
  """Waits for and returns the workdir of an uninterrupted SHORT_RUN, started as soon as a test asks
  for it so that it runs beside that test's own runs (two cores)."""
  workdir = tmp_path_factory.mktemp("reference")
  process = start_train(workdir, *SHORT_RUN)

  @functools.cache
  def finished():
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return workdir
  yield finished
  process.kill()
  process.wait()


def curve(workdir):
  """(step, loss, grad_norm) of every logged step."""
  return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(workdir)]


def saved_state(workdir, step):
  return jax.device_get(ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state"))


def test_sigkill_at_random_moments_ends_as_if_never_killed(short_reference, tmp_path):
  rng = random.Random(15)
  for _ in range(3):
    # A random step past any seen so far, then a random fraction of a step: mid-step, mid-save or mid-log.
    target = max(logged_steps(tmp_path), default=0) + rng.randint(1, 6)
    process = start_train(tmp_path, *SHORT_RUN)
    wait_for(lambda: process.poll() is not None or max(logged_steps(tmp_path), default=0) >= target)
    assert process.poll() is None, process.communicate()[1]
    time.sleep(rng.uniform(0, 0.3))
    process.kill()
    process.wait()
  process = start_train(tmp_path, *SHORT_RUN)
  out, err = process.communicate(timeout=300)
  assert process.returncode == 0, err
  assert "resuming from step" in out
  reference = short_reference()
  assert curve(tmp_path) == curve(reference)  # every step once, to the same bits
  jax.tree.map(np.testing.assert_array_equal, saved_state(tmp_path, 24), saved_state(reference, 24))


def test_two_runs_started_in_one_workdir_one_wins_the_other_names_it(short_reference, tmp_path):
  first = start_train(tmp_path, *SHORT_RUN)
  time.sleep(0.5)
  second = start_train(tmp_path, *SHORT_RUN)
  results = {p: p.communicate(timeout=300) for p in (first, second)}
  assert sorted(p.returncode == 0 for p in results) == [False, True], [err[-300:] for _, err in results.values()]
  winner, loser = sorted(results, key=lambda p: p.returncode)
  assert results[loser][1].strip().splitlines() == [
      f"error: {tmp_path} is in use by the run of pid {winner.pid} on {socket.gethostname()} "
      f"({tmp_path / 'run.lock'}); wait for it to end or choose another --config.workdir (delete the "
      "lock only if that run is gone)."]
  reference = short_reference()
  assert curve(tmp_path) == curve(reference)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == sorted(os.listdir(reference / "checkpoints"))
  jax.tree.map(np.testing.assert_array_equal, saved_state(tmp_path, 24), saved_state(reference, 24))


def test_a_full_disk_stops_the_run_at_the_first_failed_save(small_disk):
  # What is left free depends on how far orbax got before the disk filled (0.0 or 0.1 MiB seen).
  with pytest.raises(ValueError, match=r"^saving a checkpoint into .* failed \(.*\); one needs about 1.4 MiB "
                                       r"and 0\.[0-6] MiB are free\. The newest saved checkpoint is none"):
    train(config_for(small_disk / "run", steps=20))
  assert not (small_disk / "run" / "run.lock").exists()


def test_train_py_reports_a_full_disk_in_its_own_line_alone_and_stops_before_the_next_save(small_disk):
  process = start_train(small_disk / "run", "--config.steps=20", "--config.log_every=1")
  _, err = process.communicate(timeout=300)
  assert process.returncode == 1
  # Orbax raises a failed async save at the next save (step 20); the run checks after every step.
  assert 10 <= max(logged_steps(small_disk / "run")) < 20
  # What is left of stderr without tqdm's bar (redrawn with carriage returns): orbax's tracebacks
  # from its save threads, if any got through, and our line.
  lines = [line.strip() for line in re.split(r"[\r\n]", err) if line.strip() and not re.match(r"\s*\d+%\|", line)]
  assert len(lines) == 1, lines[:5]
  assert lines[0].startswith(f"error: saving a checkpoint into {small_disk}/run/checkpoints failed (")


def test_the_scalar_guard_drops_the_pass_over_the_new_state():
  # nonfinite_check=scalars decides from the loss, gradient norm and learning rate, so the keep-or-drop
  # select fuses into the update; full reduces over every new weight and moment, then selects apart.
  # Measured: 3.55 MB fewer accessed, 2.5 times the 1.42 MB of weights and moments.
  config = tiny_config(**{"mesh.data": 1})
  layout = plan(config, jax.devices()[:1])
  held = (layout.abstract_state["params"], layout.abstract_state["opt_state"])
  state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(held))
  accessed = {}
  for check in ("full", "scalars"):
    config.nonfinite_check = check
    accessed[check] = compile_train_step(layout, config).cost_analysis()["bytes accessed"]
  assert accessed["full"] - accessed["scalars"] >= state_bytes


@pytest.mark.parametrize("fault", ["nan loss", "inf gradient"])
def test_the_scalar_guard_leaves_the_state_as_it_was_after_a_non_finite_loss_or_gradient(fault):
  # NaN loss weights make the loss and every gradient NaN; float16 at a loss scale of 2**40 overflows
  # the gradients while the loss stays finite (the scaler's routine: halved, not counted as skipped).
  overrides = {"precision.compute": "float16", "precision.loss_scale": 2.0**40} if fault == "inf gradient" else {}
  config = config_for("unused", **{"mesh.data": 1, "nonfinite_check": "scalars", **overrides})
  layout = plan(config, jax.devices()[:1])
  state = fresh_state(layout, config.seed)
  before = jax.device_get(state)
  batch = batch_at(config, layout, 0)
  if fault == "nan loss":
    batch = {**batch, "weights": jax.device_put(np.full(batch["inputs"].shape, np.nan, np.float32),
                                                layout.batch_sharding)}
  state, metrics = make_train_step(layout, config)(state, batch)
  assert np.isfinite(float(metrics["loss"])) == (fault == "inf gradient")
  assert not np.isfinite(float(metrics["grad_norm"]))
  assert int(metrics["skipped"]) == (fault == "nan loss")
  if fault == "inf gradient":
    assert float(state["loss_scale"]["scale"]) == 2.0**39
  for after, was in zip(jax.tree.leaves(jax.device_get((state["params"], state["opt_state"]))),
                        jax.tree.leaves((before["params"], before["opt_state"]))):
    np.testing.assert_array_equal(after, was)


def test_an_unknown_nonfinite_check_is_refused_before_anything_is_written(tmp_path):
  with pytest.raises(ValueError, match=r"^nonfinite_check='cheap' is unknown; use scalars or full\.$"):
    train(config_for(tmp_path / "run", nonfinite_check="cheap"))
  assert not (tmp_path / "run").exists()
