"""Pipeline schedules compute the unpipelined numbers, run the tables they print, and 1F1B saves memory."""

import jax
import numpy as np
import pytest

from conftest import tiny_config
from parallel import analysis, schedules
from test_equivalence import assert_tree_close, loss_and_gradients, run_layout
from training.dry_run import compile_train_step
from training.state import plan

DEEP = {"model.num_layers": 8, "pipeline.microbatches": 4}  # 8 layers split over P x V = 2 x 4 or 4 x 2
LAYOUTS = {
    "pipeline=2": {"mesh.pipeline": 2, "mesh.data": 4},
    "pipeline=4": {"mesh.pipeline": 4, "mesh.data": 2},
    "pipeline=2 x tensor=2 x data=2": {"mesh.pipeline": 2, "mesh.tensor": 2, "mesh.data": 2},
}
CASES = [(layout, schedule) for layout in LAYOUTS for schedule in schedules.SCHEDULES]


@pytest.fixture(scope="module")
def reference():
  return run_layout({**DEEP, "mesh.data": 1}, jax.devices()[:1])


def overrides(layout, schedule):
  virtual = 4 if LAYOUTS[layout]["mesh.pipeline"] == 2 else 2
  return {**DEEP, **LAYOUTS[layout], "pipeline.schedule": schedule, "pipeline.virtual_stages": virtual}


@pytest.mark.parametrize("layout, schedule", CASES, ids=[f"{l} {s}" for l, s in CASES])
def test_schedule_matches_unpipelined(layout, schedule, reference):
  loss, grads = loss_and_gradients(overrides(layout, schedule), jax.devices())
  np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
  assert_tree_close(grads, reference[1], "gradient")


def test_3d_parallel_1f1b_step_matches_unpipelined(reference):
  _, _, params = run_layout(overrides("pipeline=2 x tensor=2 x data=2", "1f1b"), jax.devices())
  assert_tree_close(params, reference[2], "parameter after one AdamW step")


def temp_bytes(schedule):
  config = tiny_config(**{"mesh.pipeline": 2, "mesh.data": 4, "model.num_layers": 4, "batch_size": 32,
                          "pipeline.microbatches": 8, "pipeline.schedule": schedule})
  return analysis.memory_summary(compile_train_step(plan(config), config))["temp_bytes"]


def test_1f1b_needs_less_temporary_memory_than_gpipe():
  # M = 8 >= 2P = 4: GPipe keeps every micro-batch's activations for the backward pass, 1F1B at most 2P - 1 inputs.
  assert temp_bytes("1f1b") < temp_bytes("gpipe")


@pytest.mark.parametrize("stages, micro, virtual", [(2, 4, 1), (4, 4, 1), (4, 8, 1), (4, 8, 2), (2, 6, 3)])
def test_circular_schedule_has_the_textbook_bubble(stages, micro, virtual):
  schedule = "interleaved" if virtual > 1 else "gpipe"
  rows = schedules.timeline(schedule, stages=stages, micro=micro, virtual=virtual)
  # Each device runs every micro-batch through each of its V chunks exactly once.
  for row in rows:
    busy = [c for c in row if c != "."]
    assert len(busy) == len(set(busy)) == micro * virtual
  expected = (stages - 1) / (virtual * micro + stages - 1)
  np.testing.assert_allclose(schedules.idle_fraction(schedule, stages=stages, micro=micro,
                                                     virtual=virtual), expected)


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 8), (4, 16)])
def test_1f1b_has_gpipes_bubble(stages, micro):
  np.testing.assert_allclose(schedules.idle_fraction("1f1b", stages=stages, micro=micro),
                             (stages - 1) / (micro + stages - 1))


def test_1f1b_timeline_is_the_textbook_table():
  rows = schedules.timeline("1f1b", stages=2, micro=4)
  assert rows == [["F0", "F1", "F2/B0", "F3/B1", "B2", "B3"],
                  [".", "F0/B0", "F1/B1", "F2/B2", "F3/B3", "."]]
