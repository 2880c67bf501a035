"""Hugging Face tokenizers: --tokenizer=hf:DIR in prepare, init_from's own tokenizer, and exports that carry it."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helpers import data_config, run_reference, tiny_config, write_corpus
from input_pipeline import data
from input_pipeline.tokenizer import load_tokenizer, run_tokenizer
from tools import prepare
from tools.export import export
from training.checkpoint import Checkpoints
from training.state import init_state, plan

END = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  """A byte-level BPE of at most 300 tokens trained here on a few sentences, saved as a Hugging Face directory."""
  folder = tmp_path_factory.mktemp("tokenizer")
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[END],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator(["the mesh trains the model", "héllo wörld, 日本", "print('hello')"] * 20, trainer)
  bpe.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": END}))
  return folder


def test_an_hf_tokenizer_round_trips_text_and_names_its_end_of_text(tokenizer_dir):
  tok = load_tokenizer(f"hf:{tokenizer_dir}")
  text = "héllo wörld, 日本 and print('x')"
  ids = tok.encode(text)
  assert tok.name == f"hf:{tokenizer_dir.resolve()}" and ids.dtype == np.int32 and len(ids) < len(text.encode())
  assert tok.decode(ids) == text
  assert tok.end_of_text == Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(END)
  assert tok.decode([ids[0], tok.vocab_size + 5, ids[1]]).count("\ufffd") == 1


def test_a_folder_without_tokenizer_json_is_refused_in_one_line(tmp_path):
  with pytest.raises(ValueError, match=r"^tokenizer hf:.* has no tokenizer.json; give a directory"):
    load_tokenizer(f"hf:{tmp_path}")


def test_prepare_with_an_hf_tokenizer_writes_its_ids(tokenizer_dir, tmp_path):
  texts = write_corpus(tmp_path / "text")
  _, meta = prepare.prepare(tmp_path / "text", tmp_path / "out", tokenizer_name=f"hf:{tokenizer_dir}",
                            val_fraction=0.0)
  tok = load_tokenizer(f"hf:{tokenizer_dir}")
  assert meta["tokenizer"] == tok.name and meta["vocab_size"] == tok.vocab_size
  expected = np.concatenate([np.append(tok.encode(text), tok.end_of_text) for text in texts])
  np.testing.assert_array_equal(data.open_split(data_config(path=tmp_path / "out"), "train",
                                                vocab_size=512).tokens, expected)


def test_init_from_uses_its_own_tokenizer_and_refuses_data_another_wrote(tokenizer_dir, tmp_path):
  checkpoint = tmp_path / "checkpoint"
  shutil.copytree(tokenizer_dir, checkpoint)  # a checkpoint directory holding the same tokenizer
  own = run_tokenizer(f"hf:{checkpoint}", "byte", "synthetic")
  assert own.name == f"hf:{checkpoint.resolve()}"
  # Token data written with the same tokenizer.json elsewhere is the same tokenizer.
  assert run_tokenizer(f"hf:{checkpoint}", f"hf:{tokenizer_dir}", "data/corpus").same_as(own)
  with pytest.raises(ValueError, match=r"^data/corpus holds byte tokens, but init_from=hf:.* has its own "
                                       r"tokenizer; prepare the text with `python tools/prepare.py "
                                       r"--tokenizer=hf:.*"):
    run_tokenizer(f"hf:{checkpoint}", "byte", "data/corpus")
  assert run_tokenizer("", "byte", "data/corpus").name == "byte"


def test_export_carries_the_tokenizer_the_text_went_through_and_writes_bf16(tokenizer_dir, tmp_path):
  write_corpus(tmp_path / "text")
  prepare.prepare(tmp_path / "text", tmp_path / "tokens", tokenizer_name=f"hf:{tokenizer_dir}", val_fraction=0.0)
  tok = load_tokenizer(f"hf:{tokenizer_dir}")
  config = tiny_config(**{"mesh.data": 1, "data.source": "tokens", "data.path": str(tmp_path / "tokens"),
                          "workdir": str(tmp_path / "run"), "model.vocab_size": tok.vocab_size})
  layout = plan(config, jax.devices()[:1])
  checkpoints = Checkpoints(config.workdir, every=0, keep=1)
  checkpoints.save_now(0, init_state(layout, config.seed), config)
  checkpoints.close()
  export(config.workdir, str(tmp_path / "exported"))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "exported" / name).read_bytes() == (tokenizer_dir / name).read_bytes()
  assert json.loads((tmp_path / "exported" / "config.json").read_text())["dtype"] == "float32"
  # bfloat16: the same weights rounded, and config.json says so.
  export(config.workdir, str(tmp_path / "bf16"), dtype="bfloat16")
  full, half = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("exported", "bf16"))
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
  assert sorted(full) == sorted(half) and all(half[k].dtype == ml_dtypes.bfloat16 for k in half)
  for key in full:
    np.testing.assert_array_equal(half[key], full[key].astype(ml_dtypes.bfloat16))
  # transformers opens the export as a complete model: its tokenizer gives meshlm's ids, and the model runs.
  texts = ["héllo wörld, 日本", "the mesh trains the model"]
  np.save(tmp_path / "tokens.npy", np.stack([tok.encode(texts[1])[:4]] * 2))
  run_reference([{"tokenize": str(tmp_path / "exported"), "texts": texts, "out": str(tmp_path / "ids.json")},
                 {"logits": str(tmp_path / "exported"), "tokens": str(tmp_path / "tokens.npy"),
                  "out": str(tmp_path / "logits.npy")}], tmp_path)
  reference = json.loads((tmp_path / "ids.json").read_text())
  assert reference == {"ids": [tok.encode(text).tolist() for text in texts], "eos": tok.end_of_text}
  assert np.load(tmp_path / "logits.npy").shape == (2, 4, tok.vocab_size)
