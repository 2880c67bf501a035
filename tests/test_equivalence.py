"""Every mesh layout computes the single-device numbers: loss, gradients, and params after a step.

Tolerance: float32 throughout; layouts differ only in the order of reductions,
so loss agrees to 1e-5 relative and each gradient to 1e-5 of its largest entry.
"""

import jax
import numpy as np
import pytest

from conftest import tiny_config
from training import data
from training.state import init_state, plan
from training.step import loss_and_grads, make_train_step, placement

LAYOUTS = {
    "data=8": {"mesh.data": 8},
    "data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2},
    "tensor=4": {"mesh.data": 2, "mesh.tensor": 4},
    "fsdp data=8": {"mesh.data": 8, "sharding.zero": 3},
    "zero1 data=2 x tensor=2": {"mesh.data": 2, "mesh.tensor": 2, "sharding.zero": 1},
    "data=2 x expert=2 x tensor=2": {"mesh.data": 2, "mesh.expert": 2, "mesh.tensor": 2},
    "fsdp data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "sharding.zero": 3},
    "data=4 x sequence=2": {"mesh.data": 4, "mesh.sequence": 2},
    "data=8 remat=full": {"mesh.data": 8, "model.remat": "full"},
    "data=4 x tensor=2 remat=save_dots": {"mesh.data": 4, "mesh.tensor": 2, "model.remat": "save_dots"},
}
DEVICES_USED = {"zero1 data=2 x tensor=2": 4}


def setup(overrides, devices):
  """Config, layout, fresh state and the first batch for a layout."""
  config = tiny_config(**overrides)
  layout = plan(config, devices)
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=0, step=0, batch_size=config.batch_size,
                            seq_len=config.model.max_len, sharding=layout.batch_sharding)
  return config, layout, init_state(layout, config.seed), batch


def gradients(layout, params, batch):
  """Loss and gradients traced as the train step traces them."""

  def run(params, batch):
    with placement(layout):
      (loss, _), grads = loss_and_grads(layout, params, batch, 1)
      return loss, grads

  return jax.device_get(jax.jit(run)(params, batch))


def loss_and_gradients(overrides, devices):
  _, layout, state, batch = setup(overrides, devices)
  return gradients(layout, state["params"], batch)


def run_layout(overrides, devices):
  """Loss, gradients and post-step params for one batch on the given layout."""
  config, layout, state, batch = setup(overrides, devices)
  loss, grads = gradients(layout, state["params"], batch)
  state, _ = make_train_step(layout, config)(state, batch)
  return loss, grads, jax.device_get(state["params"])


@pytest.fixture(scope="module")
def reference():
  return run_layout({"mesh.data": 1}, jax.devices()[:1])


def assert_tree_close(actual, expected, what):
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    scale = max(np.abs(e).max(), 1e-12)
    err = np.abs(a - e).max() / scale
    assert err < 1e-5, f"{what} {jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_device(name, reference):
  devices = jax.devices()[:DEVICES_USED.get(name, 8)]
  loss, grads, params = run_layout(LAYOUTS[name], devices)
  ref_loss, ref_grads, ref_params = reference
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")
  assert_tree_close(params, ref_params, "parameter after one AdamW step")
