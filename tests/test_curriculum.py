"""A curriculum's phases: each trains as a run of its own fields would, on any layout as on one device, a run
resumes into the phase its step is in, and a curriculum the run cannot follow is refused before compiling."""

import jax
import numpy as np
import pytest

from configs.load import set_fields
from helpers import fresh_state, read_metrics, stop_at, tiny_config
from input_pipeline import data
from measure import analysis
from run import loop
from run.loop import train
from training import curriculum
from training.state import model_config, plan
from training.step import compile_train_step
from training.validate import check_run

STEPS = 6
# The first 3 steps at half the batch of sequences half as long, attending 8 positions back.
RAMP = "3:batch_size=8,model.max_len=16,model.sliding_window=8"


def run_config(workdir, **overrides):
  return tiny_config(**{"steps": STEPS, "log_every": 1, "eval_every": 0, "sample_tokens": 0, "checkpoint.every": 0,
                        "workdir": str(workdir), "curriculum": RAMP, **overrides})


def losses(workdir) -> dict:
  return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def by_hand_on_one_device(config) -> tuple[dict, list]:
  """Each step's loss as the phase's own config trains it on one device (its compiled step, its batch), and each
  phase's compiled peak bytes."""
  devices = jax.devices()[:1]
  phases = curriculum.phases(set_fields(config, {"mesh.data": 1}))
  layouts = [plan(phase.config, devices) for phase in phases]
  steps = [compile_train_step(layout, phase.config) for layout, phase in zip(layouts, phases)]
  state, split, out = fresh_state(layouts[-1], config.seed), data.open_split(config.data, "train", vocab_size=256), {}
  for step in range(config.steps):
    i = curriculum.phase_at(phases, step)
    batch = data.global_batch(split, seed=config.seed, step=step, batch_size=phases[i].config.batch_size,
                              seq_len=phases[i].config.model.max_len, sharding=layouts[i].batch_sharding)
    state, metrics = steps[i](state, batch)
    out[step + 1] = float(metrics["loss"])
  return out, [analysis.memory_summary(step)["peak_bytes"] for step in steps]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The losses of a run on data=8 from start to end."""
  workdir = tmp_path_factory.mktemp("straight")
  train(run_config(workdir))
  return losses(workdir)


def test_phases_hold_their_fields_until_their_step_then_the_configs_own():
  config = tiny_config(**{"curriculum": "3:batch_size=8,model.sliding_window=8; 5:model.sliding_window=16"})
  phases = curriculum.phases(config)
  assert [(p.end, p.config.batch_size, p.config.model.sliding_window) for p in phases] == [
      (3, 8, 8), (5, 16, 16), (None, 16, 0)]
  assert all(p.config.curriculum == "" for p in phases)
  assert curriculum.describe(phases) == (
      "curriculum: steps 1..3 batch_size 8, model.max_len 32, model.sliding_window 8; steps 4..5 batch_size 16, "
      "model.max_len 32, model.sliding_window 16; from step 6 batch_size 16, model.max_len 32, model.sliding_window 0")
  assert [curriculum.phase_at(phases, step) for step in range(7)] == [0, 0, 0, 1, 1, 2, 2]
  rows = lambda phase: phase.batch_size  # a step's cost: its batch
  assert curriculum.summed(phases, 6, rows) == 3 * 8 + 2 * 16 + 16
  assert [curriculum.steps_within(phases, budget, rows) for budget in (23, 24, 56, 71, 72, 200)] == [2, 3, 5, 5, 6, 14]


@pytest.fixture(scope="module")
def reference_and_peaks():
  return by_hand_on_one_device(run_config("unused"))


@pytest.fixture(scope="module")
def reference(reference_and_peaks):
  return reference_and_peaks[0]


def test_the_phases_change_what_is_trained_within_the_configs_own_memory(reference_and_peaks):
  reference, (first, own) = reference_and_peaks
  plain, _ = by_hand_on_one_device(run_config("unused", curriculum=""))
  assert all(plain[s] != reference[s] for s in range(1, STEPS + 1))
  assert first < own  # a quarter of the tokens


@pytest.mark.parametrize("layout", [{}, {"mesh.data": 4, "mesh.tensor": 2},
                                    {"mesh.data": 2, "mesh.sequence": 4, "attention.context": "ring"}],
                         ids=["data", "data x tensor", "ring attention"])
def test_each_phase_trains_as_its_own_fields_do_on_one_device(straight, reference, layout, tmp_path):
  if layout:
    train(run_config(tmp_path, **layout))
  trained = losses(tmp_path) if layout else straight
  assert sorted(trained) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([trained[s] for s in sorted(trained)], [reference[s] for s in sorted(trained)],
                             rtol=1e-5)


def test_a_run_stopped_in_one_phase_resumes_through_the_next_exactly(straight, tmp_path, monkeypatch):
  with monkeypatch.context() as patch:
    patch.setattr(loop, "StopRequests", stop_at(2))  # in the first phase
    train(run_config(tmp_path))
  assert max(losses(tmp_path)) == 2
  train(run_config(tmp_path))
  assert losses(tmp_path) == straight


@pytest.mark.parametrize("overrides, says", [
    ({"curriculum": "3 batch_size=8"}, r"curriculum entry '3 batch_size=8' is not STEP:field=value"),
    ({"curriculum": "3:model.num_layers=4"}, r"curriculum field 'model.num_layers' cannot vary over a run; vary "
                                             "batch_size or model.max_len or model.sliding_window"),
    ({"curriculum": "3:model.max_len=64"}, r"curriculum model.max_len=64 before step 3 must be from 1 to the config's "
                                           "own model.max_len=32"),
    ({"curriculum": "5:batch_size=8;3:batch_size=4"}, r"curriculum step 3 must come after 5"),
    ({"curriculum": "3:batch_size=32"}, r"curriculum batch_size=32 before step 3 must be from 1 to the config's own "
                                        "batch_size=16"),
    ({"curriculum": "3:model.sliding_window=64", "model.sliding_window": 16},
     r"curriculum model.sliding_window=64 before step 3 must be a window of 1 to 16 positions"),
    ({"curriculum": "3:batch_size=eight"}, r"batch_size='eight'"),
    ({"curriculum": "12:batch_size=8"}, r"curriculum's last phase ends before step 12, which steps=10 never reaches"),
    ({"curriculum": "3:batch_size=8", "fault_tolerance": "survive"},
     r"built for objective=lm with fault_tolerance=none, not objective='lm' with fault_tolerance='survive'"),
])
def test_a_curriculum_the_run_cannot_follow_is_refused_in_one_sentence(overrides, says):
  with pytest.raises(ValueError, match=says):
    check_run(tiny_config(**overrides))


def test_a_position_table_shorter_than_the_training_length_is_refused():
  with pytest.raises(ValueError, match=r"model.positions=16 must be at least model.max_len=32, the training length"):
    model_config(tiny_config(**{"model.positions": 16}))


def test_a_phase_the_mesh_cannot_split_is_refused_before_anything_is_written(tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"batch_size=4"):
    train(run_config(workdir, **{"curriculum": "3:batch_size=4"}))  # 4 sequences over data=8
  assert not workdir.exists()
