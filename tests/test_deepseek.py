"""DeepSeek-V3's routing (model/moe.py route: sigmoid scores, group-limited choice, scaled weights, an ungated
shared expert, a selection bias) and its auxiliary-loss-free balancing (training/step.py balancing_bias_updates):
equal on data x tensor x expert to one device over training steps, each layer's bias moved by its own loads on
pipeline stages as on one device, and kept through a checkpoint onto another mesh. transformers' DeepSeek-V3 is checked in tests/test_hf_checkpoint.py, latent
attention in tests/test_mla.py."""

import jax
import numpy as np
import pytest

from helpers import (STEPS, assert_params_close, assert_tree_close, loss_and_gradients, objective_and_gradients,
                     params_after_steps, setup, tiny_config, train_steps)
from model.moe import LOADS
from training.checkpoint import Checkpoints
from training.state import abstract_inputs, plan

# A first dense layer (its MLP 96 wide), then 8 experts in 4 groups, a token's top 2 within its best 2 groups,
# weights renormalised and scaled by 2.5, a shared expert beside them; balanced by the bias alone (no auxiliary
# loss), at a rate that moves it visibly in 3 steps.
DEEPSEEK = {"model.family": "llama", "model.num_layers": 3, "moe.first_dense": 1, "moe.dense_width": 96,
            "moe.experts": 8, "moe.top_k": 2, "moe.dropless": True, "moe.score": "sigmoid",
            "moe.groups": 4, "moe.group_top_k": 2, "moe.scale": 2.5, "moe.shared_width": 32,
            "moe.shared_gate": False, "moe.router_bias": True, "moe.bias_rate": 0.01, "moe.balance_weight": 0.0}
MESH = {"mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2}


def biases(params):
  return np.asarray(params["blocks"]["layers"][0]["mlp"]["router_bias"])


@pytest.fixture(scope="module")
def one_device_params():
  return params_after_steps({**DEEPSEEK, "mesh.data": 1}, jax.devices()[:1])


def test_routing_matches_one_device_on_data_tensor_expert():
  reference = loss_and_gradients({**DEEPSEEK, "mesh.data": 1}, jax.devices()[:1])
  loss, grads = loss_and_gradients({**DEEPSEEK, **MESH}, jax.devices())
  np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
  assert_tree_close(grads, reference[1], "gradient")
  # The bias changes which experts are chosen, never a weight: its gradient is zero.
  assert not np.abs(np.asarray(grads["blocks"]["layers"][0]["mlp"]["router_bias"])).any()


def test_the_bias_moves_against_the_load_and_trains_as_one_device(one_device_params):
  # Each step moves every bias by +-rate (0 where an expert's load is exactly the mean), so after STEPS steps
  # each is a multiple of the rate no larger than STEPS of them, and some moved.
  bias = biases(one_device_params)
  steps = np.round(bias / DEEPSEEK["moe.bias_rate"])
  np.testing.assert_allclose(bias, steps * DEEPSEEK["moe.bias_rate"], atol=1e-7)
  assert np.abs(steps).max() <= STEPS and np.abs(steps).max() > 0, steps
  assert_params_close(params_after_steps({**DEEPSEEK, **MESH}, jax.devices()), one_device_params,
                      "params after steps on data x tensor x expert")


# DeepSeek's routing on every layer (a pipeline refuses moe.first_dense's stack of its own), 4 layers for 2 stages.
ROUTED = {**DEEPSEEK, "model.num_layers": 4, "moe.first_dense": 0, "moe.dense_width": 0}


@pytest.fixture(scope="module")
def accumulated():
  """One device accumulating 4 micro-batches, as a pipeline of 4 runs them: the first step's objective, figures and
  gradients, and the parameters after STEPS steps."""
  config, layout, state, batch = setup({**ROUTED, "mesh.data": 1, "grad_accum": 4}, jax.devices()[:1])
  first = jax.device_get(objective_and_gradients(layout, config.grad_accum)(state["params"], batch))
  return first, jax.device_get(train_steps(config, layout, state, STEPS)["params"])


@pytest.mark.parametrize("pipeline", [
    {"mesh.pipeline": 2, "mesh.data": 2, "mesh.expert": 2},
    {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "1f1b"},
    {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "interleaved", "pipeline.virtual_stages": 2},
], ids=["gpipe with expert", "1f1b", "interleaved"])
def test_the_bias_moves_by_each_layers_loads_across_pipeline_stages(pipeline, accumulated):
  # Each stage's layers' loads come back at their places in the stack, so every layer's bias moves by its own, as
  # on one device accumulating the same 4 micro-batches: the first step's loads and gradients equal (1e-5), and
  # after the steps every bias equal (each a sum of +-rate moves; one move the other way would be 2 x 0.01 off).
  config, layout, state, batch = setup({**ROUTED, **pipeline, "pipeline.microbatches": 4}, jax.devices())
  ((loss, stats), grads), ((ref_loss, ref_stats), ref_grads) = (
      jax.device_get(objective_and_gradients(layout)(state["params"], batch)), accumulated[0])
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(stats[LOADS], ref_stats[LOADS], rtol=1e-5, atol=1e-7)
  assert_tree_close(grads, ref_grads, f"gradient on {pipeline}")
  trained, reference = biases(jax.device_get(train_steps(config, layout, state, STEPS)["params"])), biases(accumulated[1])
  assert np.abs(reference).max(-1).min() > 0  # every layer's bias moved
  np.testing.assert_allclose(trained, reference, atol=1e-7)


def test_the_bias_survives_a_checkpoint_onto_another_mesh(tmp_path, one_device_params):
  config, layout, state, _ = setup({**DEEPSEEK, **MESH}, jax.devices())
  state = train_steps(config, layout, state, STEPS)
  trained = biases(jax.device_get(state["params"]))
  checkpoints = Checkpoints(str(tmp_path), every=1, keep=1)
  try:
    checkpoints.save_now(STEPS, state, config)
    other = tiny_config(**{**DEEPSEEK, "mesh.data": 4, "mesh.expert": 2})
    other_layout = plan(other, jax.devices())
    restored = checkpoints.restore(STEPS, abstract_inputs(other_layout, other)[0])
  finally:
    checkpoints.close()
  np.testing.assert_array_equal(biases(jax.device_get(restored["params"])), trained)
  np.testing.assert_allclose(trained, biases(one_device_params), atol=1e-7)
