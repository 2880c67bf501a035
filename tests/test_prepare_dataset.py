"""tools/prepare.py --dataset: records' text field through Hugging Face datasets, tokenized in parallel."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest

from helpers import ROOT, data_config
from input_pipeline import data, prepare, tokenizer

DOCUMENTS = ["the first document", "héllo wörld\nwith a newline", "", "日本 {\"not\": \"json syntax\"}"] * 40


def read_all(folder):
  splits = [data.open_split(data_config(path=folder), name, vocab_size=256).tokens for name in ("train", "val")]
  return np.concatenate(splits)


def expected_ids(texts):
  byte = tokenizer.load_tokenizer("byte")
  return np.concatenate([np.append(byte.encode(text), byte.end_of_text) for text in texts])


def write_jsonl(path, texts):
  path.write_text("".join(json.dumps({"id": i, "text": text}) + "\n" for i, text in enumerate(texts)))


@pytest.mark.parametrize("form", ["jsonl", "parquet folder", "csv"])
def test_a_dataset_is_read_by_its_field_not_as_raw_text(form, tmp_path):
  if form == "jsonl":
    source = tmp_path / "records.jsonl"
    write_jsonl(source, DOCUMENTS)
  elif form == "parquet folder":
    source = tmp_path / "shards"
    source.mkdir()
    for i in range(2):  # two shards, read in name order
      half = DOCUMENTS[i * 80:(i + 1) * 80]
      pq.write_table(pa.table({"text": half, "n": list(range(len(half)))}), source / f"part-{i}.parquet")
  else:
    source = tmp_path / "records.csv"
    pa.csv.write_csv(pa.table({"text": DOCUMENTS, "n": list(range(len(DOCUMENTS)))}), source)
  documents, meta = prepare.prepare(None, tmp_path / "out", dataset=str(source), val_fraction=0.1)
  assert documents == len(DOCUMENTS) and meta["val_tokens"] > 0
  np.testing.assert_array_equal(read_all(tmp_path / "out"), expected_ids(DOCUMENTS))


def test_parallel_workers_write_the_same_tokens_in_order(tmp_path):
  write_jsonl(tmp_path / "records.jsonl", DOCUMENTS)
  for workers in (1, 2):
    prepare.prepare(None, tmp_path / f"out{workers}", dataset=str(tmp_path / "records.jsonl"), workers=workers)
  assert (tmp_path / "out1" / "train.bin").read_bytes() == (tmp_path / "out2" / "train.bin").read_bytes()
  assert (tmp_path / "out1" / "val.bin").read_bytes() == (tmp_path / "out2" / "val.bin").read_bytes()


@pytest.mark.parametrize("make, dataset, field, message", [
    (lambda d: write_jsonl(d / "r.jsonl", DOCUMENTS), "{d}/r.jsonl", "body",
     r"^record 0 of .*/r.jsonl has no field 'body'; its fields are id, text: pass one as --text_field"),
    (lambda d: None, "no-such-owner/no-such-dataset", "text", r"is neither a local file or folder nor a dataset"),
    (lambda d: write_jsonl(d / "r.jsonl", DOCUMENTS), "{d}/r.jsonl", "id",
     r"^record 0 of .*/r.jsonl has a int in 'id', not text; pass the field that holds each document's text"),
    # One JSON array whose field mixes types: `datasets` reads it as JSON text, each string in quotes.
    (lambda d: (d / "r.json").write_text(json.dumps([{"text": 30 if i == 30 else t} for i, t in enumerate(DOCUMENTS)])),
     "{d}/r.json", "text", r"^record 30 of .*/r.json has a int in 'text', not text; pass the field that holds"),
    (lambda d: (d / "mixed").mkdir() or write_jsonl(d / "mixed" / "a.jsonl", DOCUMENTS)
     or (d / "mixed" / "b.txt").write_text("x"), "{d}/mixed", "text", r"mixes formats \(json, text\)"),
])
def test_bad_datasets_are_refused_and_write_nothing(make, dataset, field, message, tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  make(tmp_path)
  with pytest.raises(ValueError, match=message):
    prepare.prepare(None, tmp_path / "out", dataset=dataset.format(d=tmp_path), text_field=field)
  assert not (tmp_path / "out").exists()


def test_the_command_line_refuses_in_one_line(tmp_path):
  command = [sys.executable, "tools/prepare.py", f"--output={tmp_path}/out", f"--input={tmp_path}",
             f"--dataset={tmp_path}"]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and result.stderr == (
      "prepare.py: give one of --input (a folder of text files) and --dataset (records with a text field).\n")
  assert not (tmp_path / "out").exists()


def test_a_folder_of_json_is_not_tokenized_as_text(tmp_path):
  write_jsonl(tmp_path / "r.jsonl", DOCUMENTS)
  with pytest.raises(ValueError, match=r"holds no text files .*; for json, jsonl or parquet records use --dataset"):
    prepare.prepare(tmp_path, tmp_path / "out")
