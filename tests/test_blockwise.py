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
from training.step import compile_train_step


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
# a sliding window of 40 of the 128 positions (splash's local mask) with scores soft-capped (the kernel's own cap;
# 0.02 bites at initialisation, tests/test_softcap.py).
@pytest.mark.parametrize("mesh, packed", [({"mesh.data": 1}, {}),
                                          ({"mesh.data": 4, "mesh.tensor": 2}, {"model.document_end": 10}),
                                          ({"mesh.data": 1}, {"model.sliding_window": 40,
                                                              "model.attention_softcap": 0.02})])
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


def head_and_input(family, **overrides):
  """A tiny model whose logits spread like a trained one's (the final norm's scale 30: logits of standard
  deviation about 5, not 0.16), a batch of inputs to its head, next tokens, and weights averaging 1."""
  config = tiny_config(**{**({"model.family": "llama"} if family == "llama" else {}), "model.loss_chunk": 8,
                          **overrides})
  cfg = model_config(config)
  with nnx.use_eager_sharding(False):
    model = build_model(cfg, seed=0)
  norm = model.ln_final if family == "gpt2" else model.norm_final
  norm.scale[...] = norm.scale[...] * 30
  x = jax.random.normal(jax.random.key(1), (4, cfg.max_len, cfg.embed_dim)).astype(cfg.dtype)
  targets = jax.random.randint(jax.random.key(2), (4, cfg.max_len), 0, cfg.vocab_size)
  weights = jax.random.uniform(jax.random.key(3), (4, cfg.max_len)) * 2
  return model, x, targets, weights


def full_logits_loss(model, x, targets, weights):
  """The reference: float32 logits for every position, log-softmax, one-hot, weighted mean."""
  logprobs = jax.nn.log_softmax(model.logits(x), axis=-1)
  return -(logprobs * jax.nn.one_hot(targets, logprobs.shape[-1]) * weights[..., None]).sum(-1).mean()


def chunked_loss(model, x, targets, weights):
  return chunked_cross_entropy(model, x, targets, weights)


def loss_and_head_gradients(loss, model, x, targets, weights):
  """The loss, and its gradients of the model's parameters and of the head's input."""
  value, (d_model, d_x) = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(model, x, targets, weights)
  return value, jax.tree.leaves(d_model) + [d_x]


# The unpadded vocabulary unweighted; GPT-2's 50257 tokens, padded to 50304 (the mask), weighted; and muP's
# output multiplier (1/2 here). Float32 logits in both: the gradients differ by rounding (1.2e-6 at most,
# as much as before the chunks read the matmul's output themselves).
@pytest.mark.parametrize("family, overrides, weighted", [
    ("gpt2", {}, False), ("llama", {}, False),
    ("gpt2", {"model.vocab_size": 50257}, True), ("llama", {"model.vocab_size": 50257}, True),
    ("gpt2", {"model.vocab_size": 50257, "mup.base_width": 32}, True)])
def test_chunked_loss_equals_full_logits(family, overrides, weighted):
  model, x, targets, weights = head_and_input(family, **overrides)
  weights = weights if weighted else jnp.ones_like(weights)
  expected, expected_grads = loss_and_head_gradients(full_logits_loss, model, x, targets, weights)
  actual, actual_grads = loss_and_head_gradients(chunked_loss, model, x, targets, weights)
  np.testing.assert_allclose(actual, expected, rtol=1e-6)
  assert_tree_close(actual_grads, expected_grads, "loss gradient", tolerance=2e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bfloat16_chunked_loss_follows_float32(family):
  """The chunks read the head's bfloat16 output and write its gradient in bfloat16, float32 only inside
  the reductions; the reference rounds the same logits and the same gradient to bfloat16, in float32
  arrays between them."""
  model, x, targets, weights = head_and_input(family, **{"model.vocab_size": 50257,
                                                         "precision.compute": "bfloat16"})
  model32, _, _, _ = head_and_input(family, **{"model.vocab_size": 50257})
  actual, actual_grads = loss_and_head_gradients(chunked_loss, model, x, targets, weights)
  reference, reference_grads = loss_and_head_gradients(full_logits_loss, model, x, targets, weights)
  exact, exact_grads = loss_and_head_gradients(full_logits_loss, model32, x.astype(jnp.float32), targets, weights)
  # The same float32 sums of the same bfloat16 logits: equal losses. The head's gradient leaves each
  # chunk's matmul rounded to bfloat16 (model/layers.py matmul), by up to 2^-8 relative, four times over
  # four chunks where the reference rounds once: 2.8e-3 of its largest entry here, held to 2^-7; the other
  # gradients agree to 2e-7.
  np.testing.assert_allclose(actual, reference, rtol=1e-6)
  assert_tree_close(actual_grads, reference_grads, "loss gradient against the float32 arrays", tolerance=2.0**-7)
  # Against float32 logits: each logit is rounded by up to 2^-8, which averages over the 128 positions'
  # losses to 2^-8 / sqrt(128) = 3.5e-4 (8.2e-5 here); a gradient takes the rounding of every probability
  # (a logit of 5 is off by up to 5 x 2^-8 = 0.02, its probability by 2%): 1.3e-2 here, for the reference
  # too, held to 2^-6 (4 ulps), as tests/helpers.py holds a bfloat16 step's weight gradients.
  np.testing.assert_allclose(actual, exact, rtol=2.0**-8 / np.sqrt(128))
  assert_tree_close(actual_grads, exact_grads, "loss gradient against float32", tolerance=2.0**-6)


def float32_logits(compiled_text, vocab, elements):
  """The float32 arrays of at least `elements` entries whose last axis is `vocab` that a compiled program
  writes: the results of its top-level instructions (a fusion's output, not the values inside it)."""
  fused = set(re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", compiled_text))
  found, computation = [], None
  for line in compiled_text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      computation = line.removeprefix("ENTRY").split()[0].lstrip("%")
    elif computation not in fused and (result := re.match(r"\s*(?:ROOT\s+)?%?\S+\s*=\s*(.+?)\s[\w\-]+\(", line)):
      found += [f"f32[{dims}]" for dims in re.findall(r"f32\[([\d,]*)\]", result.group(1))
                if dims.split(",")[-1] == str(vocab) and np.prod([int(d) for d in dims.split(",")]) >= elements]
  return found


@pytest.mark.parametrize("tensor", [1, 2])
def test_the_bfloat16_step_writes_no_float32_logits(tensor):
  """GPT-2's vocabulary in the tiny model's bfloat16 train step, on one device and split over `tensor`:
  no array the size of a chunk's logits is written in float32 (before: the masked logits, the target's
  select and the exponentials, a chunk's tokens x the local vocabulary x 4 bytes each)."""
  config = tiny_config(**{"precision.compute": "bfloat16", "model.vocab_size": 50257, "batch_size": 4,
                          "model.loss_chunk": 64, "mesh.data": 1, "mesh.tensor": tensor})
  compiled = compile_train_step(plan(config, jax.devices()[:tensor]), config)
  local_vocab = model_config(config).padded_vocab // tensor
  assert float32_logits(compiled.as_text(), local_vocab, elements=64 * local_vocab) == []


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
