"""Sliding-window attention (model.sliding_window, Mistral's): every attention path at a length several windows
long against the one-block path, in float32. transformers' Mistral is checked in tests/test_hf_checkpoint.py,
the KV cache in tests/test_sample.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_layout_matches, assert_tree_close, loss_and_gradients, qkv
from model.attention import attention_block, blockwise_attention
from parallel.context import zigzag_order

WINDOW = 6  # positions each query sees, its own included: 32-token sequences are five windows and more


@pytest.mark.parametrize("block, order, packed", [(16, "in order", False), (8, "zig-zag", False),
                                                  (8, "in order", True)])
def test_blockwise_attention_in_a_window_equals_one_block(block, order, packed):
  t = 64
  q, k, v = qkv(t, t)
  positions = jnp.asarray(zigzag_order(t, 2) if order == "zig-zag" else np.arange(t))
  segments_BT = jnp.asarray(np.repeat([[0, 1, 2, 3]], 2, axis=0).repeat(t // 4, axis=1))  # four documents
  segments = (segments_BT, segments_BT) if packed else None

  def loss(attend, q, k, v):
    out, lse = attend(q, k, v, positions, positions, segments=segments, window=WINDOW)
    weights = jnp.arange(out.size).reshape(out.shape) / out.size
    return (out * weights).sum() + jnp.sin(lse).sum(), (out, lse)

  blockwise = lambda *a, **kw: blockwise_attention(*a, block=block, **kw)
  (_, expected), expected_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(attention_block, q, k, v)
  (_, actual), actual_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(blockwise, q, k, v)
  assert_tree_close(actual, expected, "windowed attention")
  assert_tree_close(actual_grads, expected_grads, "windowed attention gradient")
  # The window changes the result: without it the same call differs.
  unwindowed = attention_block(q, k, v, positions, positions, segments)[0]
  assert np.abs(np.asarray(unwindowed - expected[0])).max() > 0.1


def test_key_blocks_outside_the_window_are_skipped_by_a_branch():
  """Flash attention's loops over key blocks branch on whether a block is in the window (lax.cond, which runs
  one side), forward and backward; without a window they score every block as before."""
  q, k, v = qkv(64, 64)
  positions = jnp.arange(64)

  def program(window):
    loss = lambda q, k, v: blockwise_attention(q, k, v, positions, positions, 8, window=window)[0].sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()

  assert program(WINDOW).count("stablehlo.case") >= 2 and "stablehlo.case" not in program(0)


MODEL = {"model.family": "llama", "model.num_heads": 8, "model.kv_heads": 4, "model.mlp_dim": 192,
         "model.sliding_window": WINDOW}
PACKED = {"model.document_end": 10}  # the built-in corpus's lines, each a document
LAYOUTS = {
    "blockwise, attention_block=8": ({"model.attention_block": 8, "mesh.data": 1}, False),
    "ring sequence=4 x data=2": ({"mesh.sequence": 4, "mesh.data": 2, "attention.context": "ring"}, False),
    "ulysses sequence=2 x tensor=2 x data=2": ({"mesh.sequence": 2, "mesh.tensor": 2, "mesh.data": 2,
                                                "attention.context": "ulysses"}, False),
    "allgather sequence=4 x data=2, blocks of 4": ({"mesh.sequence": 4, "mesh.data": 2, "model.attention_block": 4,
                                                    "attention.context": "allgather"}, False),
    "ring sequence=4 x data=2, packed": ({"mesh.sequence": 4, "mesh.data": 2, "attention.context": "ring"}, True),
}


@pytest.fixture(scope="module")
def one_block():
  """One device, each sequence one block of attention: unpacked and packed."""
  return {packed: loss_and_gradients({**MODEL, **(PACKED if packed else {}), "mesh.data": 1}, jax.devices()[:1])
          for packed in (False, True)}


def test_the_window_changes_the_loss(one_block):
  # At initialisation attention is near uniform, so the window moves the loss little (7e-4 relative), but
  # 70 times the 1e-5 the layouts below are held to.
  loss, _ = loss_and_gradients({**MODEL, "model.sliding_window": 0, "mesh.data": 1}, jax.devices()[:1])
  assert abs(loss - one_block[False][0]) > 1e-4 * loss


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_attention_path_in_a_window_matches_one_block(name, one_block):
  overrides, packed = LAYOUTS[name]
  assert_layout_matches({**MODEL, **(PACKED if packed else {}), **overrides}, one_block[packed], name)
