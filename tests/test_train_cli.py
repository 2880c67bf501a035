"""`python train.py` end to end, `--dry_run`, and bad input refused in one line before compiling."""

import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT, read_metrics
from run.run_name import default_workdir, workdir_of


def run_train(*flags, devices=8):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
             "--xla_backend_optimization_level=0")
  return subprocess.run([sys.executable, "train.py", *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_train_end_to_end(tmp_path):
  result = run_train("--config.steps=6", "--config.log_every=3", "--config.eval_every=6",
                     "--config.sample_tokens=8", "--config.mesh.data=4", "--config.mesh.tensor=2",
                     "--config.model.num_layers=1", f"--config.workdir={tmp_path}")
  assert result.returncode == 0, result.stderr
  records = read_metrics(tmp_path)
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [3, 6]
  assert set(steps[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "skipped",
                           "peak_bytes"}
  assert steps[1]["loss"] < steps[0]["loss"]
  assert any("eval_loss" in r for r in records)
  assert "sample: 'def " in result.stdout
  assert os.listdir(tmp_path / "tensorboard")


def test_dry_run_reports_memory_and_collectives(tmp_path):
  # --simulate_devices overrides the 8 devices the environment asks for.
  result = run_train("--dry_run", "--simulate_devices=4", "--config.mesh.data=2", "--config.mesh.tensor=2",
                     f"--config.workdir={tmp_path}")
  assert result.returncode == 0, result.stderr
  assert "parameters: " in result.stdout and "(4 devices)" in result.stdout
  assert "memory: temporaries (grads + activations)" in result.stdout
  assert "all-reduce over tensor" in result.stdout and "estimate MiB" in result.stdout
  # measure/saved_for_backward.py's section: the tiny model's MLP pre-activation, 512 float32 values per
  # token, is 4 x 512 / (2 x 128) = 8 D-units.
  assert "saved for the backward pass, per token of one layer" in result.stdout
  assert re.search(r"\n +8\.00 +2,048  f32\[1,128,512\] +model/mlp\.py:\d+ add: up = up \+ bias", result.stdout), result.stdout
  assert "beside the compiled step's temporaries" in result.stdout
  assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, says", [
    (["--config.mesh.data=3"], "has 3 devices but 8 are present"),
    (["--config.mesh.tensor=8"], "model.num_heads=4 is not divisible by mesh.tensor=8"),
    (["--config.mesh.dtaa=2"], "no field 'dtaa' (did you mean 'data'?)"),
    (["--config.data.source=tokens", "--config.data.path=/no/such/dir"], "/no/such/dir"),
    (["--config.batch_size=12"], "not divisible by the data-parallel degree"),
    (["--config=configs/gpt2.py:9b"], "unknown GPT-2 variant '9b'"),
    (["--config=configs/nope.py"], "the config file 'configs/nope.py' cannot be loaded"),
    (["--config.steps=3", "--config=configs/gpt2.py:tiny"], "give --config=FILE first, then the"),
    (["--config.optimizer.lr=nan"], "optimizer.lr=nan must be a finite number >= 0"),
])
def test_bad_input_is_one_line(flags, says, tmp_path):
  result = run_train(*flags, f"--config.workdir={tmp_path / 'run'}")
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr
  assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("overrides", [[], ["--config.steps=3"]], ids=["alone", "with overrides"])
def test_a_config_file_with_a_syntax_error_is_one_line(overrides, tmp_path):
  config_file = tmp_path / "broken.py"
  config_file.write_text("def get_config(:\n  pass\n")
  result = run_train(f"--config={config_file}", *overrides, f"--config.workdir={tmp_path / 'run'}")
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      f"error: the config file '{config_file}' has a syntax error at line 1 (invalid syntax); fix it, or "
      "give another such as configs/gpt2.py:tiny."]
  assert not (tmp_path / "run").exists()


def test_a_run_without_a_workdir_is_named_from_its_command():
  assert default_workdir([]) == "runs/gpt2-tiny"
  moe = ["--config=configs/gpt2.py:moe_tiny", "--config.mesh.expert=4"]
  assert re.fullmatch(r"runs/gpt2-moe_tiny-[0-9a-f]{8}", default_workdir(moe))
  # Written either way absl reads it, the same command; the cadence of logs and saves, and each process's id
  # in a multi-host run, do not change what is trained.
  assert default_workdir(["--config", "configs/gpt2.py:moe_tiny", "--config.mesh.expert", "4"]) == default_workdir(moe)
  assert default_workdir([*moe, "--config.log_every=1", "--config.checkpoint.every=5",
                          "--config.distributed.process_id=1"]) == default_workdir(moe)
  # What it trains, its layout or its length: another run, in a place of its own.
  others = [["--config.precision.compute=float16"], ["--config.steps=100"], ["--config.mesh.data=8"],
            ["--config.data.source=tokens", "--config.data.path=data/a"], ["--config=configs/llama.py:tiny"]]
  assert len({default_workdir(flags) for flags in others} | {"runs/gpt2-tiny"}) == len(others) + 1
  # tools/launch.py watches the workdir its processes write to.
  assert workdir_of(["train.py", *moe]) == (ROOT / default_workdir(moe)).resolve()
  assert workdir_of(["train.py", *moe, "--config.workdir=runs/x"]) == (ROOT / "runs/x").resolve()


def test_train_writes_where_its_command_names_it(tmp_path):
  # From another directory: the workdir is relative to where train.py is run, as a given one is.
  flags = ["--config.steps=2", "--config.eval_every=0", "--config.sample_tokens=0", "--config.model.num_layers=1",
           "--config.mesh.data=8"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
             PYTHONPATH=str(ROOT))
  result = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert f"writing to {default_workdir(flags)}" in result.stdout
  assert [r["step"] for r in read_metrics(tmp_path / default_workdir(flags)) if "loss" in r] == [2]
