"""Fingerprints are exact, the same on any mesh, and change with any one element."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from training.fingerprint import fingerprints
from training.state import init_state, plan


def test_hand_worked_fingerprints():
  # Element 0 has weight 1; element 1 has 0x9E3779B9 ^ (0x9E3779B9 >> 16) | 1 = 0x9E37E78F.
  assert int(fingerprints(jnp.float32(1.0))) == 0x3F800000
  assert int(fingerprints(jnp.array([0, 1], jnp.uint32))) == 0x9E37E78F
  assert int(fingerprints(jnp.array([3, 1], jnp.int32))) == (3 + 0x9E37E78F) % 2**32
  assert int(fingerprints(jnp.array([1.0, 0.0], jnp.bfloat16))) == 0x3F80  # widened from 16 bits
  assert int(fingerprints(jnp.array([True, True]))) == (1 + 0x9E37E78F) % 2**32


@pytest.fixture(scope="module")
def one_and_eight():
  """The tiny model's state (params, Adam moments, counters) on 1 device, and split over 8."""
  config = tiny_config(**{"mesh.data": 2, "mesh.tensor": 4, "sharding.zero": 3})
  one = init_state(plan(tiny_config(**{"mesh.data": 1}), jax.devices()[:1]), config.seed)
  layout = plan(config)
  eight = jax.device_put(one, layout.state_shardings)
  assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
             for leaf in jax.tree.leaves(eight))
  return one, eight


def test_the_same_state_on_one_device_and_over_eight_has_the_same_fingerprints(one_and_eight):
  one, eight = one_and_eight
  assert jax.device_get(fingerprints(one)) == jax.device_get(fingerprints(eight))
  as_bf16 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, tree)
  assert jax.device_get(fingerprints(as_bf16(one))) == jax.device_get(fingerprints(as_bf16(eight)))


def test_one_ulp_in_one_element_changes_that_leafs_fingerprint_only(one_and_eight):
  one, eight = one_and_eight
  kernel = np.array(eight["params"]["blocks"]["mlp"]["up_kernel"])
  kernel[1, 37, 200] = np.nextafter(kernel[1, 37, 200], np.float32(np.inf))
  changed = {**eight, "params": {**eight["params"], "blocks": {**eight["params"]["blocks"], "mlp": {
      **eight["params"]["blocks"]["mlp"],
      "up_kernel": jax.device_put(kernel, eight["params"]["blocks"]["mlp"]["up_kernel"].sharding)}}}}
  before, after = jax.device_get(fingerprints(one)), jax.device_get(fingerprints(changed))
  assert after["params"]["blocks"]["mlp"]["up_kernel"] != before["params"]["blocks"]["mlp"]["up_kernel"]
  after["params"]["blocks"]["mlp"]["up_kernel"] = before["params"]["blocks"]["mlp"]["up_kernel"]
  assert after == before
