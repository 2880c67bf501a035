"""Hugging Face directories meshlm cannot use, and exports it cannot write: refused in one line.

No transformers here: the directories are stand-ins (a config.json that transformers would read,
tensors that need not fit it, since the refusals come before any tensor is matched to a weight).
"""

import errno
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import save_file

from helpers import ROOT, tiny_config
from interop import hf_checkpoint, hf_mapping
from interop.export import export
from run.loop import train
from training.state import plan

TENSORS = {"transformer.wte.weight": np.ones((3, 4), np.float32), "transformer.wpe.weight": np.ones(5, np.float32)}
# Sharded, each tensor in its own file, as save_pretrained would split them.
SHARDS = {"transformer.wte.weight": "model-00001-of-00002.safetensors",
          "transformer.wpe.weight": "model-00002-of-00002.safetensors"}


def hf_directory(directory: Path, *, sharded: bool) -> Path:
  """A directory whose config.json is the tiny GPT-2's, with TENSORS in one file or in SHARDS and an index."""
  directory.mkdir()
  cfg = plan(tiny_config(), jax.devices()[:1]).model
  (directory / "config.json").write_text(json.dumps(hf_mapping.hf_config(cfg, tied=True)))
  if not sharded:
    save_file(TENSORS, directory / hf_checkpoint.WEIGHTS)
    return directory
  for name, file in SHARDS.items():
    save_file({name: TENSORS[name]}, directory / file)
  write_index(directory, {"weight_map": SHARDS})
  return directory


def write_index(directory: Path, index) -> None:
  (directory / hf_checkpoint.WEIGHTS_INDEX).write_text(json.dumps(index))


def refuse_after(damage, directory: Path, workdir: Path, says: str) -> None:
  """`directory` opens as it is; once `damage` is done to it, train() refuses it in one line, writing nothing."""
  hf_checkpoint.open_checkpoint(str(directory))
  damage()
  with pytest.raises(ValueError, match=says) as raised:
    train(tiny_config(init_from=f"hf:{directory}", workdir=str(workdir)))
  assert "\n" not in str(raised.value)
  assert not workdir.exists(), "nothing is written for a directory that is refused"


@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "{outside}/model.safetensors",
                                   "shards/../../outside/model.safetensors"])
def test_an_index_naming_files_outside_its_directory_is_refused(tmp_path, entry):
  directory = hf_directory(tmp_path / "model", sharded=True)
  outside = tmp_path / "outside"
  outside.mkdir()
  save_file(TENSORS, outside / "model.safetensors")  # it exists: the name alone is what is refused
  entry = entry.format(outside=outside)
  refuse_after(lambda: write_index(directory, {"weight_map": {**SHARDS, "transformer.wte.weight": entry}}),
               directory, tmp_path / "run", rf"names {entry}, which lies outside {directory}; an index may only "
                                            r"name files in its own directory \(relative names without '\.\.'\)\.$")


@pytest.mark.parametrize("index, says", [
    ({"metadata": {}}, r"'s weight_map is missing, not an object from tensor names to file names; load the "
                       r"model in transformers and save_pretrained it again"),
    ({"weight_map": list(SHARDS.values())}, r"'s weight_map is a JSON list, not an object"),
    ({"weight_map": {**SHARDS, "transformer.wpe.weight": 2}},
     r"gives transformer.wpe.weight the file 2, not a file name; load the model"),
    ({"weight_map": {**SHARDS, "transformer.wpe.weight": ""}}, r"gives transformer.wpe.weight the file '', not a"),
    ({"weight_map": {**SHARDS, "transformer.wpe.weight": None}}, r"gives transformer.wpe.weight the file None"),
    ([SHARDS], r"index.json holds a JSON list, not an object; load the model"),
    ({"weight_map": {**SHARDS, "transformer.wpe.weight": SHARDS["transformer.wte.weight"]}},
     r"index.json puts transformer.wpe.weight in .*model-00001-of-00002.safetensors, which does not hold it"),
    ({"weight_map": {**SHARDS, "transformer.wpe.weight": "model-00003-of-00002.safetensors"}},
     r"names model-00003-of-00002.safetensors, which is not in .*; download it again"),
], ids=["missing", "list", "number", "empty name", "null", "not an object", "wrong file", "absent file"])
def test_a_malformed_index_is_refused(tmp_path, index, says):
  directory = hf_directory(tmp_path / "model", sharded=True)
  refuse_after(lambda: write_index(directory, index), directory, tmp_path / "run", says)


def test_an_index_that_is_not_json_is_refused(tmp_path):
  directory = hf_directory(tmp_path / "model", sharded=True)
  refuse_after(lambda: (directory / hf_checkpoint.WEIGHTS_INDEX).write_text('{"weight_map": {'), directory,
               tmp_path / "run", r"index.json cannot be read as JSON \(Expecting .*\); load the model")


def header_change(file: Path, change) -> None:
  """Rewrite the JSON header of a safetensors file with `change` applied, its data as it was."""
  raw = file.read_bytes()
  length = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + length])
  change(header["transformer.wte.weight"])
  text = json.dumps(header).encode()
  file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def cut(file: Path, keep) -> None:
  file.write_bytes(file.read_bytes()[:keep])


LIES = r"invalid (shape, data type, or )?offset for tensor"  # safetensors' own check of the header
# (damage to a safetensors file, what safetensors says of it)
DAMAGE = {
    "truncated": (lambda f: cut(f, -4), "incomplete metadata, file not fully covered"),
    "cut in its header": (lambda f: cut(f, 20), "invalid header length"),
    "empty": (lambda f: cut(f, 0), "header too small"),
    "shape lies": (lambda f: header_change(f, lambda t: t.update(shape=[3, 5])), LIES),
    "dtype lies": (lambda f: header_change(f, lambda t: t.update(dtype="F64")), LIES),
    "offsets past the end": (lambda f: header_change(f, lambda t: t.update(data_offsets=[0, 4096])), LIES),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_safetensors_file_is_refused(tmp_path, damage, sharded):
  directory = hf_directory(tmp_path / "model", sharded=sharded)
  file = directory / (SHARDS["transformer.wte.weight"] if sharded else hf_checkpoint.WEIGHTS)
  change, says = DAMAGE[damage]
  refuse_after(lambda: change(file), directory, tmp_path / "run",
               rf"^{file} cannot be read as safetensors \(Error while deserializing header: {says}.*\): it is "
               r"truncated or damaged; download it again, or load the model in transformers")


@pytest.fixture
def read_only(tmp_path):
  """An empty folder this process cannot write in; root ignores permissions, so for root a read-only tmpfs."""
  folder = tmp_path / "read-only"
  folder.mkdir()
  if os.geteuid() == 0:
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=4k", "tmpfs", str(folder)],
                      capture_output=True).returncode:
      pytest.skip("this machine does not let the tests mount a tmpfs, and root may write anywhere else")
  else:
    folder.chmod(0o555)
  assert not os.access(folder, os.W_OK)
  yield folder
  if os.geteuid() == 0:
    subprocess.run(["umount", str(folder)], check=True)
  else:
    folder.chmod(0o755)


@pytest.mark.parametrize("output", [".", "new/deeper"], ids=["the folder", "below it"])
def test_export_refuses_a_folder_it_cannot_write_before_reading_anything(tmp_path, read_only, output):
  with pytest.raises(ValueError, match=rf"^{read_only / output if output != '.' else read_only} cannot be "
                                       rf"written \({read_only} is not writable\); export to a folder you can "
                                       r"write in\.$") as raised:
    export(str(tmp_path / "run"), str(read_only / output))
  assert "\n" not in str(raised.value)
  assert os.listdir(read_only) == [] and not (tmp_path / "run").exists()


def test_export_py_says_so_in_one_line(tmp_path, read_only):
  result = subprocess.run([sys.executable, "tools/export.py", f"--workdir={tmp_path / 'run'}",
                           f"--output={read_only / 'new'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and result.stdout == ""
  assert result.stderr.splitlines() == [f"export.py: {read_only / 'new'} cannot be written ({read_only} is not "
                                        "writable); export to a folder you can write in."]


def zero_params():
  layout = plan(tiny_config(), jax.devices()[:1])
  return layout.model, jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), layout.abstract_state["params"])


# How a full disk reaches the export: as an OSError from Python's own writes, and as safetensors' own error
# (not an OSError) from its writer, whose text holds the OS's.
FULL = {"OSError": lambda filename: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename),
        "SafetensorError": lambda filename: SafetensorError("Error while serializing: I/O error: No space left on "
                                                            "device (os error 28)")}


@pytest.mark.parametrize("raised", FULL)
def test_an_export_that_fails_midway_leaves_nothing(tmp_path, monkeypatch, raised):
  cfg, params = zero_params()

  def disk_fills(tensors, filename, metadata):
    Path(filename).write_bytes(b"half a file")
    raise FULL[raised](filename)

  monkeypatch.setattr(hf_checkpoint, "save_file", disk_fills)
  target = tmp_path / "new" / "deeper" / "exported"
  with pytest.raises(ValueError, match=rf"^writing {target} failed \(.*No space left on device.*\), so nothing was "
                                       r"written; the export needs 0\.5 MiB and [\d.]+ MiB are free: make room or export to "
                                       r"another folder\.$"):
    hf_checkpoint.write(str(target), cfg, params)
  assert os.listdir(tmp_path) == [], "no part of the export, nor the folders made for it, is left"


def test_an_export_onto_a_full_disk_says_so_in_one_line_and_leaves_nothing(tmp_path):
  full = tmp_path / "full"
  full.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)],
                                         capture_output=True).returncode:
    pytest.skip("a full disk needs a small tmpfs, which only root on a machine that allows it may mount")
  try:
    cfg, params = zero_params()  # 0.5 MiB of weights
    with pytest.raises(ValueError, match=rf"^writing {full / 'new' / 'exported'} failed \(Error while serializing: "
                                         r"I/O error: No space left on device.*\), so nothing was written; the export "
                                         r"needs 0\.5 MiB and 0\.\d MiB are free: make room or export to another "
                                         r"folder\.$"):
      hf_checkpoint.write(str(full / "new" / "exported"), cfg, params)
    assert os.listdir(full) == [], "no part of the export, nor the folders made for it, is left"
  finally:
    subprocess.run(["umount", str(full)], check=True)


@pytest.mark.parametrize("file, variant", [("llama", "tiny"), ("qwen", "qwen2_tiny"), ("qwen", "qwen3_tiny"),
                                           ("gemma", "gemma2_tiny")])
def test_an_import_whose_kv_heads_the_tensor_axis_does_not_divide_is_refused_writing_nothing(tmp_path, file, variant):
  layout = plan(importlib.import_module(f"configs.{file}").get_config(variant), jax.devices()[:1])  # 2 kv heads
  params = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), layout.abstract_state["params"])
  directory = hf_checkpoint.write(str(tmp_path / "model"), layout.model, params)
  with pytest.raises(ValueError, match=r"^model.kv_heads=2 is not divisible by mesh.tensor=4; choose sizes that "
                                       r"divide\.$"):
    train(tiny_config(init_from=f"hf:{directory}", workdir=str(tmp_path / "run"), sample_tokens=0,
          **{"mesh.data": 2, "mesh.tensor": 4}))
  assert not (tmp_path / "run").exists()
