"""Every mesh layout computes the single-device numbers: loss, gradients, and params after a few steps.

Tolerance: float32 throughout; layouts differ only in the order of reductions,
so loss agrees to 1e-5 relative and each gradient and parameter to 1e-5 of its
largest entry (GPT-2's key bias apart: see KEY_BIAS_BOUND). Parameters are
compared after STEPS steps, not one: the first step's learning rate is 0
(linear warmup from 0), and AdamW's first real update is about lr x sign(g),
blind to the gradient's size; later ones weigh each gradient against the
moments of the earlier ones, so a gradient wrong in size from one step to the
next, or in sign, shows. bfloat16 has its own tolerances (BF16_*).
"""

import jax
import numpy as np
import pytest

from conftest import tiny_config
from input_pipeline import data
from model.placement import placed
from parallel import placement
from training.state import init_state, plan
from training.step import loss_and_grads, make_train_step

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
STEPS = 3  # warmup's lr = 0 at step 0, then two AdamW updates that see the moments of three gradients


def batch_at(config, layout, step):
  """Training batch `step` of the built-in corpus, laid out for the layout."""
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  return data.global_batch(split, seed=0, step=step, batch_size=config.batch_size,
                           seq_len=config.model.max_len, sharding=layout.batch_sharding)


def setup(overrides, devices):
  """Config, layout, fresh state and the first batch for a layout."""
  config = tiny_config(**overrides)
  layout = plan(config, devices)
  return config, layout, init_state(layout, config.seed), batch_at(config, layout, 0)


def gradients(layout, params, batch):
  """Loss and gradients traced as the train step traces them."""

  def run(params, batch):
    with placed(placement.for_layout(layout)):
      (loss, _), grads = loss_and_grads(layout, params, batch, 1)
      return loss, grads

  return jax.device_get(jax.jit(run)(params, batch))


def loss_and_gradients(overrides, devices):
  _, layout, state, batch = setup(overrides, devices)
  return gradients(layout, state["params"], batch)


def train_steps(config, layout, state, steps):
  """`state` after the train steps on batches 0 .. steps - 1 (the state is donated)."""
  step = make_train_step(layout, config)
  for i in range(steps):
    state, _ = step(state, batch_at(config, layout, i))
  return state


def run_layout(overrides, devices):
  """Loss and gradients of the first batch, and the params after STEPS train steps, on the given layout."""
  config, layout, state, batch = setup(overrides, devices)
  loss, grads = gradients(layout, state["params"], batch)
  return loss, grads, jax.device_get(train_steps(config, layout, state, STEPS)["params"])


@pytest.fixture(scope="module")
def reference():
  return run_layout({"mesh.data": 1}, jax.devices()[:1])


def assert_tree_close(actual, expected, what, tolerance=1e-5):
  """Each leaf within `tolerance` of its expected largest entry; the trees must have the same structure."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected), f"{what}: the trees differ"
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    scale = max(np.abs(e).max(), 1e-12)
    err = np.abs(a - e).max() / scale
    assert err < tolerance, f"{what} {jax.tree_util.keystr(path)}: relative error {err:.2e}"


# GPT-2's key bias has no gradient in exact arithmetic: q . b_k adds one constant to all of a query's
# scores, which the softmax cancels. In float32 its gradient is rounding noise (|g| ~ 1e-12) that AdamW
# divides by eps = 1e-8, moving it by ~lr x 1e-4 per update, differently on each layout: far below any
# real update (~lr), but not within 1e-5 of the query and value biases it shares a leaf with. It is
# held to this bound instead: two updates of at most lr |g| / eps = 3e-3 x 1e-11 / 1e-8 = 3e-6 each.
KEY_BIAS_BOUND = 1e-5


def without_key_bias(params, what):
  """`params` with GPT-2's key bias zeroed, once it is shown to be below KEY_BIAS_BOUND."""
  def strip(path, leaf):
    if not jax.tree_util.keystr(path).endswith("['qkv_bias']"):
      return leaf
    leaf = np.array(leaf)  # (..., q/k/v, heads, head_dim)
    assert np.abs(leaf[..., 1, :, :]).max() < KEY_BIAS_BOUND, f"{what}: the key bias moved like a weight"
    leaf[..., 1, :, :] = 0
    return leaf

  return jax.tree_util.tree_map_with_path(strip, params)


def assert_params_close(actual, expected, what):
  """assert_tree_close for parameters after training steps, the key bias held to KEY_BIAS_BOUND."""
  assert_tree_close(without_key_bias(actual, what), without_key_bias(expected, what), what)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_device(name, reference):
  devices = jax.devices()[:DEVICES_USED.get(name, 8)]
  loss, grads, params = run_layout(LAYOUTS[name], devices)
  ref_loss, ref_grads, ref_params = reference
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")
  assert_params_close(params, ref_params, f"parameter after {STEPS} steps")


# bfloat16 keeps 8 significant bits, so a value computed in it is rounded by up to 2^-8 relative, one way
# on one layout and the other way on another. The loss is float32 arithmetic on bfloat16 logits whose
# rounding errors average over the batch's 512 per-token losses: 2^-8 / sqrt(512) = 1.7e-4. A gradient
# of a weight is a float32-accumulated product of bfloat16 operands that may each differ by an ulp:
# within 2^-6 (4 ulps) of its largest entry (0.6% at most here). GPT-2's projection and MLP biases are
# added in bfloat16, so their gradients are sums over the batch's tokens in bfloat16 whose error grows
# with the count, and each layout sums in its own order: 11% here, held to 25% (a missing reduction over
# data would be 88%).
BF16_LOSS_RTOL = 2.0**-8 / np.sqrt(512)
BF16_WEIGHT_GRADIENT_TOLERANCE = 2.0**-6
BF16_BIAS_GRADIENT_TOLERANCE = 0.25


def assert_bf16_gradients_close(grads, ref_grads, what):
  """assert_tree_close at bfloat16's tolerances: the biases added in bfloat16 (`*_bias`) apart."""
  def split(tree):
    added_in_bf16 = lambda path: jax.tree_util.keystr(path).endswith("_bias']")
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ({jax.tree_util.keystr(p): x for p, x in flat if added_in_bf16(p)},
            {jax.tree_util.keystr(p): x for p, x in flat if not added_in_bf16(p)})

  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads), f"{what}: the trees differ"
  (biases, weights), (ref_biases, ref_weights) = split(grads), split(ref_grads)
  assert_tree_close(weights, ref_weights, what, BF16_WEIGHT_GRADIENT_TOLERANCE)
  assert_tree_close(biases, ref_biases, f"{what} (bias added in bfloat16)", BF16_BIAS_GRADIENT_TOLERANCE)


@pytest.fixture(scope="module")
def bf16_reference():
  return loss_and_gradients({"mesh.data": 1, "precision.compute": "bfloat16"}, jax.devices()[:1])


def test_bf16_fsdp_tensor_layout_matches_single_device_bf16(bf16_reference):
  loss, grads = loss_and_gradients({**LAYOUTS["fsdp data=4 x tensor=2"], "precision.compute": "bfloat16"},
                                   jax.devices())
  np.testing.assert_allclose(loss, bf16_reference[0], rtol=BF16_LOSS_RTOL)
  assert_bf16_gradients_close(grads, bf16_reference[1], "bfloat16 gradient")
