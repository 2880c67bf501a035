"""GPT-2 in three parts: embed(tokens) -> x, a scanned stack of blocks, head(x, targets) -> loss.

A pipeline schedule composes the same three parts across stages, so nothing
here knows about stages, devices or meshes.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import SelfAttention
from model.config import ModelConfig
from model.layers import INIT_STD, LayerNorm, matmul, param
from model.mlp import Mlp
from model.sharding_hooks import constrain

ACTIVATION_AXES = ("batch", "length", "embed")
STACKED = "blocks"  # the parameters stacked on a leading `layers` axis, which pipelines split into stages

REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls
}


class Block(nnx.Module):
  """Pre-LayerNorm transformer block."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.ln_attn = LayerNorm(cfg.embed_dim)
    self.attn = SelfAttention(cfg, rngs)
    self.ln_mlp = LayerNorm(cfg.embed_dim)
    self.mlp = Mlp(cfg, rngs)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    x_BTD = x_BTD + self.attn(self.ln_attn(x_BTD))
    x_BTD = constrain(x_BTD, ACTIVATION_AXES)
    x_BTD = x_BTD + self.mlp(self.ln_mlp(x_BTD))
    return constrain(x_BTD, ACTIVATION_AXES)


class Embed(nnx.Module):
  """Token and learned position embeddings; the token table is tied to the output head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.tokens = param(rngs, (cfg.padded_vocab, cfg.embed_dim), ("vocab", "embed"))
    self.positions = param(rngs, (cfg.max_len, cfg.embed_dim), (None, "embed"), std=INIT_STD / 2)


class GPT2(nnx.Module):
  """Learned positions, pre-LN blocks, tanh-GELU MLP, tied embeddings, biases everywhere."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embed(cfg, rngs)
    self.blocks = _stacked_blocks(cfg, rngs)
    self.ln_final = LayerNorm(cfg.embed_dim)

  def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
    length = tokens_BT.shape[1]
    x_BTD = self.embed.tokens[...][tokens_BT] + self.embed.positions[:length]
    return constrain(x_BTD.astype(self.cfg.dtype), ACTIVATION_AXES)

  def run_blocks(self, x_BTD: jax.Array) -> jax.Array:
    def apply_block(x_BTD, block):
      return block(x_BTD)

    if self.cfg.remat != "none":
      apply_block = nnx.remat(apply_block, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
    return nnx.scan(apply_block, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x_BTD, self.blocks)

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    """Float32 logits over the real vocabulary; padding entries can never be predicted."""
    x_BTD = self.ln_final(x_BTD)
    logits_BTV = matmul("btd,vd->btv", x_BTD, self.embed.tokens[...], self.cfg.dtype).astype(jnp.float32)
    logits_BTV = constrain(logits_BTV, ("batch", "length", "vocab"))
    real_V = jnp.arange(self.cfg.padded_vocab) < self.cfg.vocab_size
    return jnp.where(real_V, logits_BTV, jnp.finfo(jnp.float32).min)

  def head_loss(self, x_BTD: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32."""
    logprobs_BTV = jax.nn.log_softmax(self.logits(x_BTD), axis=-1)
    # A one-hot contraction rather than a gather: with `vocab` sharded it is a
    # local product and one reduction, which every partitioner handles.
    targets_BTV = jax.nn.one_hot(targets_BT, self.cfg.padded_vocab, dtype=logprobs_BTV.dtype)
    return -jnp.einsum("btv,btv->bt", logprobs_BTV, targets_BTV).mean()

  def __call__(self, tokens_BT: jax.Array, targets_BT: jax.Array) -> jax.Array:
    return self.head_loss(self.run_blocks(self.embed_tokens(tokens_BT)), targets_BT)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """One Block whose every parameter has a leading `layers` axis of size num_layers."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return Block(cfg, rngs)

  return make(rngs)
