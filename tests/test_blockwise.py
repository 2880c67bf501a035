"""Memory-linear attention and loss: blockwise attention and the chunked head equal the plain math."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import LLAMA, assert_tree_close, loss_and_gradients, qkv, tiny_config
from model.attention import attention_block, blockwise_attention, kernel
from model.transformer import chunk_count, chunked_cross_entropy
from parallel.context import zigzag_order
from parallel.checks import attention_kernel
from training.state import build_model, model_config, plan


@pytest.mark.parametrize("overrides, backend, expected", [
    ({"precision.compute": "bfloat16"}, "gpu", "cudnn"),
    ({"precision.compute": "float16"}, "gpu", "cudnn"),
    ({"precision.compute": "float32"}, "gpu", "xla"),  # cuDNN's fused attention is half precision only
    ({"precision.compute": "float8"}, "gpu", "xla"),
    ({"precision.compute": "bfloat16"}, "cpu", "xla"),
    ({"precision.compute": "bfloat16", "model.max_len": 256}, "tpu", "splash"),
    ({"precision.compute": "float32", "model.max_len": 128}, "tpu", "splash"),
    ({"precision.compute": "bfloat16"}, "tpu", "xla"),  # 32 positions: not a whole 128-position tile
    ({"precision.compute": "bfloat16", "model.embed_dim": 1024, "model.num_heads": 4}, "gpu", "xla"),  # head 256
    ({"precision.compute": "bfloat16", "model.embed_dim": 60, "model.num_heads": 5}, "gpu", "xla"),  # head 12
    ({"precision.compute": "float32", "model.attention": "cudnn"}, "cpu", "cudnn"),  # asked for: as asked
    ({"precision.compute": "bfloat16", "model.attention": "xla"}, "gpu", "xla"),
])
def test_auto_attention_takes_cudnn_only_where_it_applies(overrides, backend, expected):
  assert kernel(model_config(tiny_config(**overrides)), backend) == expected


SPLASH = {"model.attention": "splash", "model.max_len": 128}


@pytest.mark.parametrize("overrides, shape, platform, expected", [
    ({"model.max_len": 128}, {}, "tpu", "splash"),
    ({"model.max_len": 128}, {"pipeline": 2}, "tpu", "xla"),  # splash's shard_map cannot nest in a stage
    ({"model.max_len": 128}, {"sequence": 2}, "tpu", "xla"),  # a context strategy attends
    ({"model.max_len": 128, "model.document_end": 0}, {}, "tpu", "splash"),  # with its segment ids
    ({"precision.compute": "bfloat16", "model.document_end": 0}, {}, "gpu", "xla"),  # cuDNN has none here
    ({"precision.compute": "bfloat16"}, {"pipeline": 2}, "gpu", "cudnn"),
    (SPLASH, {}, "cpu", "splash"),  # asked for: Pallas' interpreter off a TPU
])
def test_a_plan_makes_auto_attention_concrete(overrides, shape, platform, expected):
  mesh = {"data": 1, "pipeline": 1, "expert": 1, "sequence": 1, "tensor": 1, **shape}
  assert attention_kernel(model_config(tiny_config(**overrides)), mesh, platform) == expected


# One device, a sharded mesh with packed documents (the unpacked sharded case added nothing either lacks), and
# a sliding window of 40 of the 128 positions (splash's local mask).
@pytest.mark.parametrize("mesh, packed", [({"mesh.data": 1}, {}),
                                          ({"mesh.data": 4, "mesh.tensor": 2}, {"model.document_end": 10}),
                                          ({"mesh.data": 1}, {"model.sliding_window": 40})])
def test_splash_attention_equals_the_xla_kernel(mesh, packed):
  # Off a TPU the splash kernel runs in Pallas' interpreter, per device through parallel/context.py per_device.
  # Packed documents (the built-in corpus's lines, ended by a newline) go in as the kernel's segment ids.
  devices = jax.devices()[:1] if mesh["mesh.data"] == 1 else jax.devices()
  ref_loss, ref_grads = loss_and_gradients({**mesh, **SPLASH, **packed, "model.attention": "xla"}, devices)
  loss, grads = loss_and_gradients({**mesh, **SPLASH, **packed}, devices)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")


@pytest.mark.parametrize("overrides, says", [
    ({**SPLASH, "mesh.data": 4, "mesh.pipeline": 2}, "cannot nest inside mesh.pipeline=2's stages"),
    ({"model.attention": "splash"}, "model.max_len=32 is not divisible by splash attention's 128-position tiles"),
    ({"model.attention": "cudnn", "model.document_end": 0}, "cannot be masked by model.attention=cudnn"),
])
def test_splash_where_it_cannot_run_is_refused_in_one_line(overrides, says):
  with pytest.raises(ValueError, match=re.escape(says)):
    plan(tiny_config(**overrides))


@pytest.mark.parametrize("t, s, block, order", [
    (64, 64, 16, "in order"), (64, 64, 16, "zig-zag"), (64, 64, 24, "in order"), (8, 64, 16, "decode")])
def test_blockwise_attention_equals_one_block(t, s, block, order):
  q, k, v = qkv(t, s)
  k_positions = jnp.asarray(zigzag_order(s, 2) if order == "zig-zag" else np.arange(s))
  q_positions = k_positions if t == s else jnp.arange(s - t, s)  # decoding: the last t positions

  def loss(attend, q, k, v):
    out, lse = attend(q, k, v, q_positions, k_positions)
    # Weight the outputs so every position's gradient differs; the log-sum-exp enters the loss as a ring's
    # merge uses it, so its cotangent is checked too.
    weights = jnp.arange(out.size).reshape(out.shape) / out.size
    return (out * weights).sum() + jnp.sin(lse).sum(), (out, lse)

  blockwise = lambda *a: blockwise_attention(*a, block=block)
  (_, expected), expected_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(
      attention_block, q, k, v)
  (_, actual), actual_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(blockwise, q, k, v)
  assert_tree_close(actual, expected, "attention")
  assert_tree_close(actual_grads, expected_grads, "attention gradient")


def attention_temporaries(t, block):
  q, k, v = qkv(t, t, heads=2, kv_heads=2, head_dim=16)
  positions = jnp.arange(t)
  loss = lambda q, k, v: blockwise_attention(q, k, v, positions, positions, block=block)[0].sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_attention_memory_grows_linearly():
  short, long = attention_temporaries(1024, 128), attention_temporaries(4096, 128)
  # Four times the sequence: linear is 4x; T x T scores would be 16x.
  assert long / short < 5, (short, long)
  one_block = attention_temporaries(1024, 1024)
  assert short < one_block / 2, (short, one_block)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_chunked_loss_equals_full_logits(family):
  config = tiny_config(**({"model.family": "llama"} if family == "llama" else {}), **{"model.loss_chunk": 8})
  cfg = model_config(config)
  with nnx.use_eager_sharding(False):
    model = build_model(cfg, seed=0)
  x = jax.random.normal(jax.random.key(1), (4, cfg.max_len, cfg.embed_dim))
  targets = jax.random.randint(jax.random.key(2), (4, cfg.max_len), 0, cfg.vocab_size)

  def plain(model, x):  # the reference: float32 logits for every position, log-softmax, one-hot
    logprobs = jax.nn.log_softmax(model.logits(x), axis=-1)
    return -(logprobs * jax.nn.one_hot(targets, logprobs.shape[-1])).sum(-1).mean()

  expected, expected_grads = nnx.value_and_grad(plain, argnums=(0, 1))(model, x)
  actual, actual_grads = nnx.value_and_grad(lambda m, x: chunked_cross_entropy(m, x, targets), argnums=(0, 1))(model, x)
  np.testing.assert_allclose(actual, expected, rtol=1e-6)
  assert_tree_close(jax.tree.leaves(actual_grads), jax.tree.leaves(expected_grads), "loss gradient")


def test_chunk_count_divides_the_length():
  assert [chunk_count(32, c) for c in (8, 10, 32, 100)] == [4, 4, 1, 1]
  assert chunk_count(30, 7) == 5


# Small attention blocks, loss chunks and MLP chunks (the last recomputed in backward) against the plain math.
BLOCKS = {"model.attention_block": 8, "model.loss_chunk": 8, "model.mlp_chunk": 8}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_small_blocks_and_chunks_match_the_plain_run(family):
  base = {**(LLAMA if family == "llama" else {"model.num_heads": 8}), "mesh.data": 1}
  loss, grads = loss_and_gradients({**base, **BLOCKS}, jax.devices()[:1])
  ref_loss, ref_grads = loss_and_gradients({**base, "model.attention_block": 32, "model.loss_chunk": 32},
                                           jax.devices()[:1])
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")


@pytest.fixture(scope="module")
def one_device_gpt2():
  return loss_and_gradients({"model.num_heads": 8, "mesh.data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "allgather"])
def test_small_blocks_sharded_over_sequence_tensor_and_data(strategy, one_device_gpt2):
  base = {"model.num_heads": 8, "mesh.data": 1}
  ref_loss, ref_grads = one_device_gpt2
  loss, grads = loss_and_gradients({**base, **BLOCKS, "mesh.sequence": 2, "mesh.tensor": 2, "mesh.data": 2,
                                    "attention.context": strategy}, jax.devices())
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_tree_close(grads, ref_grads, "gradient")
