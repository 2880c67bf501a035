"""Every mesh layout computes the single-device numbers: loss, gradients, and params after a few steps.

Tolerance: float32 throughout; layouts differ only in the order of reductions,
so loss agrees to 1e-5 relative and each gradient and parameter to 1e-5 of its
largest entry (GPT-2's key bias apart: see KEY_BIAS_BOUND in helpers.py). Parameters are
compared after STEPS steps, not one: the first step's learning rate is 0
(linear warmup from 0), and AdamW's first real update is about lr x sign(g),
blind to the gradient's size; later ones weigh each gradient against the
moments of the earlier ones, so a gradient wrong in size from one step to the
next, or in sign, shows. bfloat16 has its own tolerances (BF16_* in helpers.py).
"""

import jax
import numpy as np
import pytest

from helpers import (BF16_LOSS_RTOL, STEPS, assert_half_gradients_close, assert_params_close, assert_tree_close,
                     loss_and_gradients, run_layout)

LAYOUTS = {
    "data=8": {"mesh.data": 8},
    "data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2},
    "tensor=4": {"mesh.data": 2, "mesh.tensor": 4},
    "fsdp data=8": {"mesh.data": 8, "sharding.zero": 3},
    "zero1 data=2 x tensor=2": {"mesh.data": 2, "mesh.tensor": 2, "sharding.zero": 1},
    "data=2 x expert=2 x tensor=2": {"mesh.data": 2, "mesh.expert": 2, "mesh.tensor": 2},
    "fsdp data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "sharding.zero": 3},
    "hsdp data=8 in groups of 4": {"mesh.data": 8, "sharding.zero": 3, "sharding.fsdp_group": 4},
    "data=4 x sequence=2": {"mesh.data": 4, "mesh.sequence": 2},
    "data=8 remat=full": {"mesh.data": 8, "model.remat": "full"},
    "data=4 x tensor=2 remat=save_dots": {"mesh.data": 4, "mesh.tensor": 2, "model.remat": "save_dots"},
}
DEVICES_USED = {"zero1 data=2 x tensor=2": 4}


@pytest.fixture(scope="module")
def reference():
  return run_layout({"mesh.data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_device(name, reference):
  devices = jax.devices()[:DEVICES_USED.get(name, 8)]
  loss, grads, params = run_layout(LAYOUTS[name], devices)
  ref_loss, ref_grads, ref_params = reference
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")
  assert_params_close(params, ref_params, f"parameter after {STEPS} steps")


@pytest.fixture(scope="module")
def bf16_reference():
  return loss_and_gradients({"mesh.data": 1, "precision.compute": "bfloat16"}, jax.devices()[:1])


def test_bf16_fsdp_tensor_layout_matches_single_device_bf16(bf16_reference):
  loss, grads = loss_and_gradients({**LAYOUTS["fsdp data=4 x tensor=2"], "precision.compute": "bfloat16"},
                                   jax.devices())
  np.testing.assert_allclose(loss, bf16_reference[0], rtol=BF16_LOSS_RTOL)
  assert_half_gradients_close(grads, bf16_reference[1], "bfloat16 gradient")
