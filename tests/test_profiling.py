"""`profile_steps`: a trace of the chosen steps lands in <workdir>/profile; bad windows are refused."""

import pytest

from helpers import tiny_config
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
