"""Multi-token prediction (model/mtp.py): the objective equals one written out by truncation rather than masks, and
a mesh's loss and gradients equal one device's, under data x tensor with ZeRO-3 and a zig-zag ring over `sequence`,
and with DeepSeek-V3's routed layers on data x tensor x expert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_layout_matches, batch_at, loss_and_gradients, setup
from model import mtp

MTP = {"model.mtp_depth": 2, "model.mtp_weight": 0.5}


def truncated_objective(model, tokens_BT, targets_BT, weight):
  """The objective with each module run on the positions it scores only: causal attention makes a prefix's
  hidden states those of the whole sequence, so module k on the first T - k positions, reading token i+k and
  scoring token i+k+1 straight from the sequence, needs no mask and no shifted copies."""
  length = tokens_BT.shape[1]
  sequence_BS = jnp.concatenate([tokens_BT[:, :1], targets_BT], axis=1)  # token j at j
  hidden_BTD, _ = model.run_blocks(model.embed_tokens(tokens_BT))
  loss = model.head_loss(hidden_BTD, targets_BT)
  graphdef, stack = nnx.split(getattr(model, mtp.MTP))
  losses = []
  for k in range(1, model.cfg.mtp_depth + 1):
    module = nnx.merge(graphdef, jax.tree.map(lambda p: p[k - 1], stack))
    kept = length - k
    hidden_BTD = module(hidden_BTD[:, :kept], model.embed_tokens(sequence_BS[:, k:k + kept]), jnp.arange(kept))
    logits_BtV = model.logits(hidden_BTD)
    future_Bt = sequence_BS[:, k + 1:k + 1 + kept]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits_BtV), future_Bt[..., None], -1)[..., 0]
    losses.append(-picked.mean())
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


def test_routed_layers_with_a_dense_first_layer_match_one_device():
  # DeepSeek-V3's shape: a dense first layer 96 wide, routed layers after it, the module's feed-forward layer dense
  # and as wide as the first layer's.
  deepseek = {"model.family": "llama", "model.num_layers": 3, "moe.first_dense": 1, "moe.dense_width": 96,
              "moe.experts": 4, "moe.top_k": 2, "moe.dropless": True, "model.mtp_depth": 1}
  _, layout, state, _ = setup({**deepseek, "mesh.data": 1}, jax.devices()[:1])
  assert state["params"][mtp.MTP]["block"]["mlp"]["up_kernel"].shape == (1, 64, 96)
  reference = loss_and_gradients({**deepseek, "mesh.data": 1}, jax.devices()[:1])
  assert_layout_matches({**deepseek, "mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2}, reference,
                        "data x tensor x expert")


def test_evaluation_reads_the_stack_alone():
  config, layout, state, _ = setup({**MTP, "mesh.data": 1}, jax.devices()[:1])
  batch = batch_at(config, layout, 0)
  model = nnx.merge(layout.graphdef, state["params"])
  _, stats = model.objective(batch["inputs"], batch["targets"])
  np.testing.assert_allclose(model(batch["inputs"], batch["targets"]), stats["cross_entropy"], rtol=1e-6)
  assert stats[mtp.LOSS] > stats["cross_entropy"]  # two and three tokens ahead are harder to guess than one
