"""Soft-capping (model.attention_softcap and model.logit_softcap, Gemma 2's): flash attention's hand-written
backward against autodiff of a dense capped softmax, and every attention path and the sharded loss against one
device, in float32. The KV cache is checked in tests/test_sample.py, splash in tests/test_blockwise.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_layout_matches, assert_tree_close, loss_and_gradients, qkv, tiny_config
from interop import hf_mapping
from model.attention import blockwise_attention
from training.state import model_config

CAP = 2.0  # the unit-normal test scores reach several times this


def dense_capped(q, k, v, cap):
  """Causal attention written out whole: the scaled scores capped, masked, softmaxed."""
  group = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) * q.shape[-1] ** -0.5
  scores = cap * jnp.tanh(scores / cap) if cap else scores
  causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), -1), v)


@pytest.mark.parametrize("block", [64, 8], ids=["one block (autodiff)", "flash blocks (its own backward)"])
def test_capped_attention_and_its_gradients_equal_the_dense_softmax(block):
  q, k, v = (x * 3 for x in qkv(64, 64))
  positions = jnp.arange(64)
  weights = jnp.arange(q.size).reshape(q.shape) / q.size
  loss = lambda attend, q, k, v: (attend(q, k, v) * weights).sum()
  blockwise = lambda q, k, v: blockwise_attention(q, k, v, positions, positions, block, softcap=CAP)[0]
  expected, expected_grads = jax.value_and_grad(loss, argnums=(1, 2, 3))(
      lambda q, k, v: dense_capped(q, k, v, CAP), q, k, v)
  actual, actual_grads = jax.value_and_grad(loss, argnums=(1, 2, 3))(blockwise, q, k, v)
  np.testing.assert_allclose(actual, expected, rtol=1e-5)
  assert_tree_close(actual_grads, expected_grads, "capped attention gradient")
  assert abs(loss(lambda q, k, v: dense_capped(q, k, v, 0.0), q, k, v) - expected) > 0.01 * abs(expected)


# Caps far below Gemma 2's 50 and 30, so that they bite at initialisation, where scores and logits are small.
MODEL = {"model.family": "llama", "model.num_heads": 8, "model.kv_heads": 4, "model.mlp_dim": 192,
         "model.attention_softcap": 0.02, "model.logit_softcap": 0.05}
LAYOUTS = {
    "one device, attention_block=8 (flash)": {"model.attention_block": 8, "mesh.data": 1},
    "data=4 x tensor=2 (vocabulary split)": {"mesh.data": 4, "mesh.tensor": 2},
    "ring sequence=4 x data=2": {"mesh.sequence": 4, "mesh.data": 2, "attention.context": "ring"},
    "ulysses sequence=2 x tensor=2 x data=2": {"mesh.sequence": 2, "mesh.tensor": 2, "mesh.data": 2,
                                               "attention.context": "ulysses"},
}


@pytest.fixture(scope="module")
def one_device():
  return loss_and_gradients({**MODEL, "mesh.data": 1}, jax.devices()[:1])


def test_each_cap_changes_what_the_layouts_are_held_to(one_device):
  # Attention is near uniform at initialisation, capped or not, so its cap moves the loss little; it scales
  # every score's gradient by 1 - (s / C)^2, and so the queries' kernels' gradients. The logits' cap moves
  # the loss itself.
  _, uncapped = loss_and_gradients({**MODEL, "model.attention_softcap": 0.0, "mesh.data": 1}, jax.devices()[:1])
  q_kernel = lambda grads: np.asarray(grads["blocks"]["attn"]["q_kernel"])
  assert np.abs(q_kernel(uncapped) - q_kernel(one_device[1])).max() > 0.1 * np.abs(q_kernel(one_device[1])).max()
  loss, _ = loss_and_gradients({**MODEL, "model.logit_softcap": 0.0, "mesh.data": 1}, jax.devices()[:1])
  assert abs(loss - one_device[0]) > 1e-3 * loss


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_attention_path_soft_capped_matches_one_device(name, one_device):
  assert_layout_matches({**MODEL, **LAYOUTS[name]}, one_device, name)


@pytest.mark.parametrize("overrides, says", [
    ({"model.attention_softcap": -1.0}, "model.attention_softcap=-1.0 must be a finite cap > 0"),
    ({"model.logit_softcap": float("inf")}, "model.logit_softcap=inf must be a finite cap > 0"),
    ({"model.attention_softcap": 50.0, "model.attention": "cudnn"}, "model.attention=cudnn cannot soft-cap"),
])
def test_a_bad_cap_is_refused_in_one_line(overrides, says):
  with pytest.raises(ValueError, match=says):
    model_config(tiny_config(**overrides))


def test_a_soft_capped_model_is_not_exported_as_an_architecture_that_does_not_cap():
  # A capped Llama would load into transformers' Llama, which does not cap, and compute something else.
  with pytest.raises(ValueError, match="model.attention_softcap=0.02, model.logit_softcap=0.05: meshlm's llama "
                                       "exports to an architecture that computes none of these; export a gemma2"):
    hf_mapping.mapping_of(model_config(tiny_config(**MODEL)))
