"""`profile_steps`: a trace of the chosen steps lands in <workdir>/profile; bad windows are refused."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT, tiny_config
from measure.profiling import parse_steps
from run.loop import train


def test_three_step_run_writes_a_trace(tmp_path):
  config = tiny_config(**{"steps": 3, "log_every": 3, "eval_every": 0, "sample_tokens": 0,
                          "checkpoint.every": 0, "profile_steps": "2,3", "workdir": str(tmp_path),
                          "model.num_layers": 1})
  train(config)
  runs = list((tmp_path / "profile" / "plugins" / "profile").iterdir())
  assert len(runs) == 1
  names = [p.name for p in runs[0].iterdir()]
  assert any(n.endswith(".xplane.pb") for n in names), names  # TensorBoard's profile plugin
  assert "perfetto_trace.json.gz" in names  # ui.perfetto.dev


@pytest.mark.parametrize("text, says", [
    ("3", "not two step numbers"), ("a,b", "not two step numbers"), ("0,2", "1 <= FIRST"),
    ("5,4", "1 <= FIRST <= LAST"), ("2,11", "LAST <= steps=10"),
])
def test_bad_windows_are_refused(text, says):
  with pytest.raises(ValueError, match=says):
    parse_steps(text, last_step=10)


def test_empty_means_no_trace():
  assert parse_steps("", last_step=10) is None and parse_steps("2,4", last_step=10) == (2, 4)


def test_trace_top_puts_the_kernel_time_on_the_model_lines(tmp_path):
  """A traced CPU run with XLA's dump: tools/trace_top.py attributes most kernel time to model/ files (78.7% in
  a full suite on 2 cores; the rest is kernels XLA made without a source line, such as broadcasts)."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={tmp_path / 'hlo'} --xla_dump_hlo_module_re=.*train_step.*",
         "JAX_PLATFORMS": "cpu"}
  train_run = [sys.executable, "train.py", "--config.steps=3", "--config.profile_steps=2,3", "--config.log_every=3",
               "--config.eval_every=0", "--config.sample_tokens=0", "--config.checkpoint.every=0",
               f"--config.workdir={tmp_path}"]
  subprocess.run(train_run, cwd=ROOT, env=env, check=True, capture_output=True, timeout=240)
  table = subprocess.run([sys.executable, "tools/trace_top.py", f"--trace={tmp_path / 'profile'}",
                          f"--hlo={tmp_path / 'hlo'}", "--steps=2"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout
  shares = {row[0]: float(row[2].rstrip("%")) for row in
            ([cell.strip() for cell in line.strip("|").split("|")] for line in table.split("\n\n")[1].splitlines()[2:])}
  assert sum(share for name, share in shares.items() if name.startswith("model/")) > 60, table
  assert "model/attention.py" in shares and "model/mlp.py" in shares, table
