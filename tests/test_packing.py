"""Packed documents (data.segments): a document packed after another computes what it computes alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import LLAMA, assert_tree_close, loss_and_gradients, qkv, tiny_config
from model.attention import attention_block, blockwise_attention
from model.transformer import document_ids, document_positions, token_losses
from run.loop import train
from training.checkpoint import Checkpoints
from training.state import build_model, model_config

END = 10  # the byte tokenizer's end of text ("\n"), which ends each line of the built-in corpus


def test_documents_and_their_positions_by_hand():
  tokens = jnp.array([[5, END, 7, 8, END, 3, 4, END]])
  segments = document_ids(tokens, END)
  assert segments.tolist() == [[0, 0, 1, 1, 1, 2, 2, 2]]  # an end of text closes its own document
  assert document_positions(segments).tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]


@pytest.mark.parametrize("t, block", [(32, 8), (32, 12)])
def test_blockwise_attention_with_segments_equals_one_block(t, block):
  q, k, v = qkv(t, t)
  positions = jnp.arange(t)
  segments = jnp.array([[0] * 12 + [1] * (t - 12), [0] * 5 + [1] * 20 + [2] * (t - 25)])

  def loss(attend, q, k, v):
    out, lse = attend(q, k, v, positions, positions, segments=(segments, segments))
    return (out * jnp.arange(out.size).reshape(out.shape) / out.size).sum() + jnp.sin(lse).sum(), (out, lse)

  blockwise = lambda *a, **kw: blockwise_attention(*a, block=block, **kw)
  (_, expected), expected_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(attention_block, q, k, v)
  (_, actual), actual_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(blockwise, q, k, v)
  assert_tree_close(actual, expected, "attention")
  assert_tree_close(actual_grads, expected_grads, "attention gradient")


@pytest.mark.parametrize("family, block", [("gpt2", 32), ("gpt2", 8), ("llama", 32), ("llama", 8)])
def test_a_packed_document_equals_the_document_alone(family, block):
  """The second document's loss and its gradients, packed after a first one or run on its own."""
  overrides = {**(LLAMA if family == "llama" else {}), "model.attention_block": block, "model.document_end": END}
  with nnx.use_eager_sharding(False):
    model = build_model(model_config(tiny_config(**overrides)), seed=0)
  rng = np.random.default_rng(0)
  first, second = rng.integers(END + 1, 200, 12), rng.integers(END + 1, 200, 21)
  packed = jnp.asarray(np.concatenate([first[:-1], [END], second[:-1]]))[None]  # 32 tokens
  targets = jnp.asarray(np.concatenate([first[1:], [second[0]], second[1:]]))[None]

  def second_document_loss(model, tokens, targets, start):
    segments = document_ids(tokens, END)
    x = model.embed_tokens(tokens, document_positions(segments))
    x, _ = model.run_blocks(x, None, segments)
    return token_losses(model.logits(x[:, start:]), targets[:, start:]).mean()

  alone, alone_grads = nnx.value_and_grad(second_document_loss)(model, packed[:, 12:], targets[:, 12:], 0)
  together, together_grads = nnx.value_and_grad(second_document_loss)(model, packed, targets, 12)
  np.testing.assert_allclose(together, alone, rtol=1e-6)
  assert_tree_close(jax.tree.leaves(together_grads), jax.tree.leaves(alone_grads), "gradient")


PACKED = {"model.num_heads": 8, "model.document_end": END}


@pytest.fixture(scope="module")
def packed_on_one_device():
  return loss_and_gradients({**PACKED, "mesh.data": 1}, jax.devices()[:1])


def test_packed_training_matches_one_device_on_data_and_tensor(packed_on_one_device):
  ref_loss, ref_grads = packed_on_one_device
  loss, grads = loss_and_gradients({**PACKED, "mesh.data": 4, "mesh.tensor": 2}, jax.devices())
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")
  # Packing changes the numbers: the built-in corpus's lines are documents.
  unpacked_loss, _ = loss_and_gradients({"model.num_heads": 8, "mesh.data": 1}, jax.devices()[:1])
  assert abs(unpacked_loss - ref_loss) > 1e-4


@pytest.mark.parametrize("context", ["allgather", "ring", "ulysses"])
def test_packed_training_matches_one_device_on_a_sharded_sequence(packed_on_one_device, context):
  # Four shards of 8 tokens: documents cross shard boundaries, and the ring's zig-zag chunks are 4 tokens.
  ref_loss, ref_grads = packed_on_one_device
  loss, grads = loss_and_gradients(
      {**PACKED, "mesh.data": 2, "mesh.sequence": 4, "attention.context": context}, jax.devices())
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")


def test_data_segments_ends_documents_at_the_tokenizers_end_of_text(tmp_path):
  config = tiny_config(**{"data.segments": True, "steps": 2, "workdir": str(tmp_path), "eval_every": 0,
                          "sample_tokens": 0, "mesh.data": 8})
  metrics = train(config)
  checkpoints = Checkpoints(config.workdir, every=0, keep=None)
  document_end = checkpoints.stored_config(2)["model"]["document_end"]  # the model the run trained and saved
  checkpoints.close()
  assert document_end == END and np.isfinite(metrics["loss"]), metrics
