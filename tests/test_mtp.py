"""Multi-token prediction (model/mtp.py): the objective equals one written out by truncation rather than masks, and
a mesh's loss and gradients equal one device's, under data x tensor with ZeRO-3 and a zig-zag ring over `sequence`,
and DeepSeek-V3's routed layers and module with their selection biases train on data x tensor x expert as on one
device. transformers' MtpModel is checked in tests/test_hf_checkpoint.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (assert_layout_matches, assert_params_close, batch_at, loss_and_gradients,
                     params_after_steps, prediction_logits, setup)
from model import mtp

MTP = {"model.mtp_depth": 2, "model.mtp_weight": 0.5}


def truncated_objective(model, tokens_BT, targets_BT, weight):
  """The objective with each module's loss read off prediction_logits, which runs module k on the positions it
  scores only, with no mask and no shifted copies."""
  sequence_BS = jnp.concatenate([tokens_BT[:, :1], targets_BT], axis=1)  # token j at j
  loss = model.head_loss(model.run_blocks(model.embed_tokens(tokens_BT))[0], targets_BT)
  losses = []
  for k, logits_BtV in enumerate(prediction_logits(model, sequence_BS), 1):
    future_Bt = sequence_BS[:, k + 1:]
    losses.append(-jnp.take_along_axis(jax.nn.log_softmax(logits_BtV), future_Bt[..., None], -1).mean())
  return loss + weight * sum(losses) / len(losses)


@pytest.fixture(scope="module")
def one_device():
  return loss_and_gradients({**MTP, "mesh.data": 1}, jax.devices()[:1])


def test_the_objective_is_the_stack_loss_plus_the_modules_mean_loss(one_device):
  config, layout, state, batch = setup({**MTP, "mesh.data": 1}, jax.devices()[:1])
  model = nnx.merge(layout.graphdef, state["params"])
  expected = truncated_objective(model, batch["inputs"], batch["targets"], MTP["model.mtp_weight"])
  np.testing.assert_allclose(one_device[0], expected, rtol=1e-5)
  # The modules learn: every one of their weights has a gradient.
  for path, grad in jax.tree_util.tree_leaves_with_path(one_device[1][mtp.MTP]):
    assert np.abs(grad).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize("overrides", [
    {"mesh.data": 4, "mesh.tensor": 2, "sharding.zero": 3},
    {"mesh.data": 2, "mesh.tensor": 2, "mesh.sequence": 2, "attention.context": "ring"},
], ids=["data-tensor-zero3", "ring-tensor"])
def test_layouts_match_one_device(overrides, one_device):
  assert_layout_matches({**MTP, **overrides}, one_device, str(overrides))


def test_routed_modules_and_their_bias_train_as_one_device_on_data_tensor_expert():
  # DeepSeek-V3's shape: a dense first layer, routed layers balanced by the selection bias, and the module's block
  # routed too, its bias moved by its own loads.
  deepseek = {"model.family": "llama", "model.num_layers": 3, "moe.first_dense": 1, "moe.dense_width": 96,
              "moe.experts": 4, "moe.top_k": 2, "moe.dropless": True, "moe.score": "sigmoid", "moe.router_bias": True,
              "moe.bias_rate": 0.01, "moe.balance_weight": 0.0, "model.mtp_depth": 1}
  reference = params_after_steps({**deepseek, "mesh.data": 1}, jax.devices()[:1])
  bias = reference[mtp.MTP]["block"]["mlp"]["router_bias"]
  assert bias.shape == (1, 4) and np.abs(bias).max() > 0, bias
  assert_params_close(params_after_steps({**deepseek, "mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2},
                                         jax.devices()), reference, "params after steps on data x tensor x expert")


def test_evaluation_reads_the_stack_alone():
  config, layout, state, _ = setup({**MTP, "mesh.data": 1}, jax.devices()[:1])
  batch = batch_at(config, layout, 0)
  model = nnx.merge(layout.graphdef, state["params"])
  _, stats = model.objective(batch["inputs"], batch["targets"])
  np.testing.assert_allclose(model(batch["inputs"], batch["targets"]), stats["cross_entropy"], rtol=1e-6)
  assert stats[mtp.LOSS] > stats["cross_entropy"]  # two and three tokens ahead are harder to guess than one
