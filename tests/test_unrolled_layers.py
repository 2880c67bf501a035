"""`model.scan_layers=False`: the layers unrolled in Python compute what the scanned stack computes."""

import jax
import pytest

from tests.helpers import LLAMA, assert_tree_close, loss_and_gradients

MOE = {"model.num_experts": 4, "model.moe_every": 2, "model.num_layers": 4}


@pytest.mark.parametrize("overrides, mesh", [
    ({"model.remat": "full"}, {}),
    (LLAMA, {"mesh.data": 2, "mesh.tensor": 2}),
    (MOE, {"mesh.data": 2, "mesh.expert": 2}),
], ids=["gpt2-remat", "llama-data-tensor", "moe-data-expert"])
def test_unrolled_layers_match_the_scan(overrides, mesh):
  devices = jax.devices()[:max(1, 2 * len(mesh))]
  ref_loss, ref_grads = loss_and_gradients({**overrides, **mesh}, devices)
  loss, grads = loss_and_gradients({**overrides, **mesh, "model.scan_layers": False}, devices)
  assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
  assert_tree_close(grads, ref_grads, "unrolled against scanned gradients")
