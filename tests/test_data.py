"""Tests for input_pipeline/data.py, input_pipeline/tokenizer.py and tools/prepare.py."""

import os

# Eight simulated CPU devices, set before jax is imported (a conftest.py may set it first).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import ROOT, data_config, fresh_state, tiny_config, write_corpus
from input_pipeline import data, prepare, token_files, tokenizer
from run.loop import train
from training.state import plan
from training.step import loss_fn

B, T = 8, 16


def toy_split(name="train", length=5000):
  tokens = (np.arange(length) * 7 % 256).astype(np.uint16)
  return data.TokenSplit(name, tokens, 256, "byte", "toy")


def rows(split, step, rows=slice(None), seed=0):
  return data.batch_rows(split, seed=seed, step=step, batch_size=B, seq_len=T, rows=rows)


SYNTHETIC = data.TokenSplit("train", None, 50, "byte", "synthetic")


@pytest.mark.parametrize("split", [toy_split(), SYNTHETIC])
def test_batch_is_a_pure_function_of_seed_step_and_split(split):
  batch = rows(split, step=3)
  assert batch.shape == (B, T + 1) and batch.dtype == np.int32
  assert 0 <= batch.min() and batch.max() < split.vocab_size
  np.testing.assert_array_equal(batch, rows(split, step=3))
  np.testing.assert_array_equal(batch, np.concatenate([rows(split, 3, slice(0, 4)),
                                                       rows(split, 3, slice(4, 8))]))
  np.testing.assert_array_equal(batch[2:5], rows(split, 3, slice(2, 5)))
  assert not np.array_equal(batch, rows(split, step=4))
  assert not np.array_equal(batch, rows(split, step=3, seed=1))
  val = data.TokenSplit("val", split.tokens, split.vocab_size, "byte", "toy")
  assert not np.array_equal(batch, rows(val, step=3))


def test_rows_are_contiguous_windows_of_the_tokens():
  split = toy_split()
  for window in rows(split, step=0):
    start = int(np.flatnonzero(split.tokens == window[0])[0])  # ids repeat every 256 tokens
    np.testing.assert_array_equal(window, split.tokens[start:start + T + 1])


def test_split_shorter_than_a_window_is_refused():
  with pytest.raises(ValueError, match=r"holds 10 tokens, fewer than seq_len \+ 1 = 17"):
    rows(toy_split(length=10), step=0)


AXES = ("data", "pipeline", "expert", "sequence", "tensor")


@pytest.mark.parametrize("axis_sizes, axis_names, spec", [
    ((8,), ("data",), P("data")),
    ((4, 2), ("data", "tensor"), P("data")),
    ((4, 2), ("data", "tensor"), P("data", "tensor")),  # length sharded too
    ((2, 1, 2, 2, 1), AXES, P(("data", "expert"), "sequence")),  # the trainer's layout
])
def test_global_batch_on_a_mesh_equals_the_numpy_batch(monkeypatch, axis_sizes, axis_names, spec):
  assert jax.device_count() >= 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
  mesh = jax.make_mesh(axis_sizes, axis_names)
  split, reads = toy_split(), []
  expected = rows(split, step=5)
  batch_rows = data.batch_rows
  monkeypatch.setattr(data, "batch_rows",
                      lambda *a, **k: reads.append(k["rows"]) or batch_rows(*a, **k))
  batch = data.global_batch(split, seed=0, step=5, batch_size=B, seq_len=T,
                            sharding=NamedSharding(mesh, spec))
  assert batch["inputs"].dtype == np.int32 and batch["inputs"].sharding.spec == spec
  inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  np.testing.assert_array_equal(inputs, expected[:, :-1])
  np.testing.assert_array_equal(targets, expected[:, 1:])
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
  # Each batch shard's rows are read once, however many devices hold them.
  rows_per_shard = batch["inputs"].sharding.shard_shape((B, T))[0]
  assert sorted(r.indices(B) for r in reads) == [(i, i + rows_per_shard, 1)
                                                for i in range(0, B, rows_per_shard)]


def build_for(split, sharding):
  return lambda step: data.global_batch(split, seed=1, step=step, batch_size=B, seq_len=T,
                                        sharding=sharding)


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_yields_the_batches_of_direct_calls(depth):
  split, sharding = toy_split(), NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
  build = build_for(split, sharding)
  with data.batches(split, seed=1, start=3, stop=7, shape_at=lambda step: (B, T),
                    sharding=sharding, depth=depth) as batches:
    got = list(batches)
  assert [step for step, _ in got] == [3, 4, 5, 6]
  for step, batch in got:
    np.testing.assert_array_equal(batch["inputs"], build(step)["inputs"])
    np.testing.assert_array_equal(batch["targets"], build(step)["targets"])


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_raises_the_workers_error(depth):
  def build(step):
    if step == 2:
      raise RuntimeError("bad step")
    return step
  batches = data.Prefetcher(build, start=0, stop=5, depth=depth)
  assert [next(batches), next(batches)] == [(0, 0), (1, 1)]
  with pytest.raises(RuntimeError, match="bad step"):
    next(batches)
  batches.close()


def test_prefetcher_closes_early():
  batches = data.Prefetcher(lambda step: step, start=0, stop=10**9, depth=2)
  with batches:
    assert next(batches) == (0, 0)
  assert not batches._worker.is_alive()  # pylint: disable=protected-access
  assert list(batches) == []
  assert not any(t.name == "meshlm-prefetch" and t.is_alive() for t in threading.enumerate())


def test_prepare_round_trips_a_folder(tmp_path):
  texts = write_corpus(tmp_path / "text")
  num_files, meta = prepare.prepare(tmp_path / "text", tmp_path / "out", val_fraction=0.25)
  assert num_files == 3 and meta["tokenizer"] == "byte" and meta["dtype"] == "uint16"
  train, val = (data.open_split(data_config(path=tmp_path / "out"), name, vocab_size=256)
                for name in ("train", "val"))
  assert isinstance(train.tokens, np.memmap) and not train.tokens.flags.writeable
  assert len(val.tokens) == round(0.25 * (len(train.tokens) + len(val.tokens)))
  decoded = tokenizer.load_tokenizer("byte").decode(np.concatenate([train.tokens, val.tokens]))
  assert decoded == "".join(text + "\n" for text in texts)
  assert not list((tmp_path / "out").glob("*.tmp*"))
  with pytest.raises(ValueError, match="already holds a prepared dataset"):
    prepare.prepare(tmp_path / "text", tmp_path / "out")
  prepare.prepare(tmp_path / "text", tmp_path / "out", val_fraction=0.0, overwrite=True)
  assert token_files.read_meta(tmp_path / "out")["val_tokens"] == 0
  (tmp_path / "binary").mkdir()
  (tmp_path / "binary" / "e.bin").write_bytes(b"\0")
  with pytest.raises(ValueError, match="holds no text files"):
    prepare.prepare(tmp_path / "binary", tmp_path / "out2")


def test_prepare_command_line(tmp_path):
  write_corpus(tmp_path / "text")
  command = [sys.executable, "tools/prepare.py", f"--input={tmp_path / 'text'}",
             f"--output={tmp_path / 'out'}"]
  first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  assert first.returncode == 0, first.stderr
  assert "from 3 documents" in first.stdout and first.stdout.count("\n") == 1
  again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  assert again.returncode == 1 and "--overwrite" in again.stderr
  assert again.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("config, message", [
    (data_config(path="/nonexistent/meshlm"), r"/nonexistent/meshlm does not exist; .*prepare.py"),
    (data_config(path=""), r"needs --config.data.path=DIR"),
    (data_config(source="imagenet"), r"data.source='imagenet' is unknown; use one of builtin"),
])
def test_bad_sources_are_refused_in_one_line(config, message):
  with pytest.raises(ValueError, match=message) as error:
    data.open_split(config, "train", vocab_size=256)
  assert "\n" not in str(error.value)


def test_damaged_folders_are_refused(tmp_path):
  write_corpus(tmp_path / "text")
  prepare.prepare(tmp_path / "text", tmp_path / "out")
  with pytest.raises(ValueError, match="set --config.model.vocab_size=256"):
    data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=100)
  (tmp_path / "out" / "val.bin").write_bytes(b"\0")
  with pytest.raises(ValueError, match=r"val.bin is missing or does not hold"):
    data.open_split(data_config(path=tmp_path / "out"), "val", vocab_size=256)
  (tmp_path / "out" / "meta.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"meta.json is missing or not valid JSON"):
    data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=256)


def test_builtin_corpus_is_large_and_stable(monkeypatch, tmp_path):
  first = data.open_split(data_config("builtin"), "train", vocab_size=256)
  val = data.open_split(data_config("builtin"), "val", vocab_size=256)
  again = data.open_split(data_config("builtin"), "train", vocab_size=256)
  assert len(first.tokens) > 1_000_000 and first.tokenizer == "byte"
  assert round(0.05 * (len(first.tokens) + len(val.tokens))) == len(val.tokens)
  np.testing.assert_array_equal(first.tokens, again.tokens)
  assert "def " in tokenizer.load_tokenizer("byte").decode(val.tokens[:20_000])
  monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))  # a fresh build equals the cached one
  rebuilt = data.open_split(data_config("builtin"), "train", vocab_size=256)
  assert rebuilt.origin.startswith(str(tmp_path))
  np.testing.assert_array_equal(first.tokens, rebuilt.tokens)


def test_byte_tokenizer_round_trips_and_replaces_bad_ids():
  byte = tokenizer.load_tokenizer("byte")
  text = "naïve café → 日本\n"
  assert byte.decode(byte.encode(text)) == text and byte.vocab_size == 256
  assert byte.decode([104, 105, 300, -1]) == "hi\ufffd\ufffd"


def test_gpt2_tokenizer_round_trips_or_says_byte_works_offline():
  try:
    gpt2 = tokenizer.load_tokenizer("gpt2")
  except ValueError as error:
    assert "gpt2 encoding could not be loaded" in str(error) and "--tokenizer=byte" in str(error)
    return
  text = "Hello <|endoftext|> world"
  assert gpt2.decode(gpt2.encode(text)) == text and gpt2.vocab_size == 50257


def test_gpt2_tokenizer_and_prepare_with_a_stand_in_encoding(monkeypatch, tmp_path):
  tiktoken = pytest.importorskip("tiktoken")
  # A byte-level BPE with GPT-2's special token, so the gpt2 path runs without the network.
  stand_in = tiktoken.Encoding("gpt2-stand-in", pat_str=r"\s+|\S+",
                               mergeable_ranks={bytes([i]): i for i in range(256)},
                               special_tokens={"<|endoftext|>": 256})
  monkeypatch.setattr(tiktoken, "get_encoding", lambda name: stand_in)
  gpt2 = tokenizer.load_tokenizer("gpt2")
  assert (gpt2.name, gpt2.vocab_size, gpt2.end_of_text) == ("gpt2", 257, 256)
  text = "Hello <|endoftext|> wörld"
  assert 256 not in gpt2.encode(text) and gpt2.decode(gpt2.encode(text)) == text
  assert gpt2.decode([104, 105, 999]) == "hi\ufffd"
  write_corpus(tmp_path / "text")
  _, meta = prepare.prepare(tmp_path / "text", tmp_path / "out", tokenizer_name="gpt2")
  assert (meta["tokenizer"], meta["vocab_size"]) == ("gpt2", 257)
  train = data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=257)
  val = data.open_split(data_config(path=tmp_path / "out"), "val", vocab_size=257)
  assert np.count_nonzero(np.concatenate([train.tokens, val.tokens]) == 256) == 3


def test_unknown_tokenizer_is_refused():
  with pytest.raises(ValueError, match="Unknown tokenizer 'bpe'"):
    tokenizer.load_tokenizer("bpe")


def test_ids_outside_the_vocabulary_are_refused_by_offset(tmp_path):
  with pytest.raises(ValueError, match=r"^token id 256 in the tokenizer's output at token 3 of .* outside "
                                       r"the vocabulary \[0, 256\)"):
    token_files.write_token_folder(tmp_path / "out", [np.array([1, 2]), np.array([3, 256, 300])],
                                   tokenizer="byte", vocab_size=256, val_fraction=0.1)
  assert not (tmp_path / "out" / "meta.json").exists()


def write_foreign_ids(folder: Path, ids: dict[int, int]) -> None:
  """Writes `ids` (offset: id) into folder's train.bin, as a file another tokenizer wrote would hold them."""
  tokens = np.memmap(folder / "train.bin", np.uint16, mode="r+")
  for offset, token_id in ids.items():
    tokens[offset] = token_id
  tokens.flush()


def test_ids_past_the_vocabulary_stop_a_run_before_it_writes_anything(tmp_path):
  write_corpus(tmp_path / "text")
  prepare.prepare(tmp_path / "text", tmp_path / "out")
  write_foreign_ids(tmp_path / "out", {700: 300, 750: 400})
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=rf"^token id 300 in {tmp_path}/out/train.bin at token 700 is outside the "
                                       r"vocabulary \[0, 256\); re-tokenize with the tokenizer meta.json names\.$"):
    train(tiny_config(**{"data.source": "tokens", "data.path": str(tmp_path / "out"), "workdir": str(workdir),
                         "eval_every": 0, "sample_tokens": 0}))
  assert not workdir.exists()  # no metrics.jsonl, no TensorBoard folder, no lock


def test_a_token_file_is_scanned_once_per_version(tmp_path):
  write_corpus(tmp_path / "text")
  prepare.prepare(tmp_path / "text", tmp_path / "out")
  train_bin = tmp_path / "out" / "train.bin"
  data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=256)
  before = train_bin.stat()
  assert json.loads((tmp_path / "out" / token_files.IDS_CHECKED).read_text()) == {
      "train.bin": {"size": before.st_size, "mtime_ns": before.st_mtime_ns, "vocab_size": 256}}
  write_foreign_ids(tmp_path / "out", {5: 300})
  os.utime(train_bin, ns=(before.st_atime_ns, before.st_mtime_ns))  # the recorded version, so not read again
  data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=256)
  os.utime(train_bin)  # another version: scanned
  with pytest.raises(ValueError, match=r"^token id 300 in .*/out/train.bin at token 5 is outside"):
    data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=256)


def test_a_read_only_token_folder_is_checked_every_time_and_left_as_it_is(tmp_path):
  write_corpus(tmp_path / "text")
  prepare.prepare(tmp_path / "text", tmp_path / "out")
  view = tmp_path / "view"
  view.mkdir()
  if subprocess.run(["mount", "--bind", str(tmp_path / "out"), str(view)], capture_output=True).returncode:
    pytest.skip("this machine does not let the tests mount a folder")
  try:
    subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
    listing = sorted(os.listdir(view))
    data.open_split(data_config(path=view), "train", vocab_size=256)
    assert sorted(os.listdir(view)) == listing  # no record, no temporary file
    write_foreign_ids(tmp_path / "out", {5: 300})  # through the writable side
    with pytest.raises(ValueError, match=r"^token id 300 in .*/view/train.bin at token 5 is outside"):
      data.open_split(data_config(path=view), "train", vocab_size=256)
  finally:
    subprocess.run(["umount", "--lazy", str(view)], check=True)  # lazily: the memmaps may still be open


def test_prepare_refuses_an_output_that_is_a_file(tmp_path):
  write_corpus(tmp_path / "text")
  (tmp_path / "taken").write_text("mine")
  with pytest.raises(ValueError, match=r"--output=.*taken is a file, not a folder"):
    prepare.prepare(tmp_path / "text", tmp_path / "taken")
  assert (tmp_path / "taken").read_text() == "mine"


@pytest.mark.parametrize("seed, data_seed", [(0, 1), (1, 0)], ids=["other data order", "other initial weights"])
def test_data_seed_sets_the_order_and_seed_the_weights(seed, data_seed, tmp_path):
  """A run's first logged loss is its initial weights' (drawn from `seed`) on batch 0 of `data.seed`'s order."""
  overrides = {"seed": seed, "data.seed": data_seed, "steps": 1, "log_every": 1, "eval_every": 0,
               "sample_tokens": 0, "workdir": str(tmp_path / "run")}
  config = tiny_config(**overrides)
  train(config)
  logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
  layout = plan(config)
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=data_seed, step=0, batch_size=config.batch_size,
                            seq_len=config.model.max_len, sharding=layout.batch_sharding)
  expected = jax.jit(lambda p, b: loss_fn(layout, p, b))(fresh_state(layout, seed)["params"], batch)
  assert logged == pytest.approx(float(expected), rel=1e-6)
  other = data.global_batch(split, seed=seed, step=0, batch_size=config.batch_size, seq_len=config.model.max_len,
                            sharding=layout.batch_sharding)
  assert float(jax.jit(lambda p, b: loss_fn(layout, p, b))(fresh_state(layout, seed)["params"], other)) != \
      pytest.approx(logged, rel=1e-4)  # the other seed's batch gives another loss: the check has teeth
