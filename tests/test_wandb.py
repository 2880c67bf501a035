"""--config.wandb.project: the run's scalars, config and commit in Weights & Biases (offline here)."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, read_metrics

FLAGS = ["--config.steps=4", "--config.log_every=2", "--config.eval_every=0", "--config.sample_tokens=0",
         "--config.batch_size=8", "--config.model.max_len=32", "--config.checkpoint.every=2"]
BLOCK = 32768


def train(workdir, *flags):
  env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "XLA_FLAGS": ""}
  return subprocess.run([sys.executable, "train.py", f"--config.workdir={workdir}", *FLAGS, *flags], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=240)


def offline_history(workdir: Path) -> list[dict]:
  """The scalars an offline W&B run recorded, read from its run file.

  The file is ":W&B", two magic bytes and a version, then LevelDB's log format
  (32 KiB blocks of records: a CRC, a little-endian length and a type; FULL =
  1, FIRST = 2, MIDDLE = 3, LAST = 4), each record one wandb_internal Record.
  """
  from wandb.proto import wandb_internal_pb2
  rows = []
  for path in sorted(workdir.glob("wandb/offline-run-*/run-*.wandb")):
    data, position, payload = path.read_bytes(), 7, b""
    while position + 7 <= len(data):
      if (left := BLOCK - position % BLOCK) < 7:  # a block's tail too short for a header is padding
        position += left
        continue
      _, length, kind = struct.unpack("<IHB", data[position:position + 7])
      payload += data[position + 7:position + 7 + length]
      position += 7 + length
      if kind == 0:
        break
      if kind in (1, 4):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        payload = b""
        if record.WhichOneof("record_type") == "history":
          rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item})
  return rows


def test_a_run_logs_the_same_scalars_to_wandb_and_resumes_the_same_run(tmp_path):
  result = train(tmp_path, "--config.wandb.project=meshlm-test", "--config.wandb.group=g")
  assert result.returncode == 0, result.stderr[-3000:]
  records = read_metrics(tmp_path)
  logged = {row["_step"]: row for row in offline_history(tmp_path)}
  assert sorted(logged) == [r["step"] for r in records] == [2, 4]
  for record in records:
    assert logged[record["step"]]["loss"] == pytest.approx(record["loss"], rel=1e-6)
  run_id = (tmp_path / "wandb_id").read_text().strip()
  # Resuming continues the same W&B run (the id kept in the workdir).
  result = train(tmp_path, "--config.wandb.project=meshlm-test", "--config.steps=6")
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / "wandb_id").read_text().strip() == run_id
  assert all(run_id in path.name for path in tmp_path.glob("wandb/offline-run-*"))
