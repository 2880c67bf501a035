"""`python train.py` end to end, `--dry_run`, and bad input refused in one line before compiling."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT, read_metrics


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
