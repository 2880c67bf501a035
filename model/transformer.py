"""What every family shares: the scanned stack of blocks, the loss, and the three-part interface.

A model is embed(tokens, positions) -> x, a scanned stack of identical blocks
(parameters stacked under STACKED on a leading `layers` axis), and
head_loss(x, targets) -> loss. A pipeline schedule composes the same three
parts across stages, so nothing here knows about stages, devices or meshes.
Positions are explicit so a context strategy may reorder the sequence.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.sharding_hooks import constrain

ACTIVATION_AXES = ("batch", "length", "embed")
STACKED = "blocks"  # the parameters stacked on a leading `layers` axis, which pipelines split into stages

REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls
}


def stacked(block_class, cfg: ModelConfig, rngs: nnx.Rngs):
  """One block whose every parameter has a leading `layers` axis of size num_layers."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return block_class(cfg, rngs)

  return make(rngs)


def scan_blocks(blocks, x_BTD, positions_T, cfg: ModelConfig):
  """Run the stacked blocks in order with nnx.scan, under the configured remat policy."""

  def apply_block(x_BTD, block, positions_T):
    return constrain(block(x_BTD, positions_T), ACTIVATION_AXES)

  if cfg.remat != "none":
    apply_block = nnx.remat(apply_block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
  return nnx.scan(apply_block, in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)(x_BTD, blocks, positions_T)


def masked_vocab(logits_BTV, cfg: ModelConfig):
  """Float32 logits in which the vocabulary's padding can never be predicted."""
  logits_BTV = constrain(logits_BTV.astype(jnp.float32), ("batch", "length", "vocab"))
  real_V = jnp.arange(cfg.padded_vocab) < cfg.vocab_size
  return jnp.where(real_V, logits_BTV, jnp.finfo(jnp.float32).min)


def cross_entropy(logits_BTV, targets_BT):
  """Mean next-token cross-entropy in float32."""
  logprobs_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  # A one-hot contraction rather than a gather: with `vocab` sharded it is a
  # local product and one reduction, which every partitioner handles.
  targets_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logprobs_BTV.dtype)
  return -jnp.einsum("btv,btv->bt", logprobs_BTV, targets_BTV).mean()


class LanguageModel(nnx.Module):
  """The stack and the loss every family shares.

  A family adds `embed_tokens(tokens_BT, positions_T) -> x_BTD` and
  `logits(x_BTD) -> logits_BTV`, and keeps its stacked blocks in `self.blocks`.
  """

  def run_blocks(self, x_BTD, positions_T=None):
    positions_T = jnp.arange(x_BTD.shape[1]) if positions_T is None else positions_T
    return scan_blocks(self.blocks, x_BTD, positions_T, self.cfg)

  def head_loss(self, x_BTD, targets_BT):
    return cross_entropy(self.logits(x_BTD), targets_BT)

  def __call__(self, tokens_BT, targets_BT, positions_T=None):
    positions_T = jnp.arange(tokens_BT.shape[1]) if positions_T is None else positions_T
    x_BTD = self.run_blocks(self.embed_tokens(tokens_BT, positions_T), positions_T)
    return self.head_loss(x_BTD, targets_BT)
