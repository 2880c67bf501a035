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

from model.attention import ATTENTION_OUT
from model.config import ModelConfig
from model.moe import AUX_LOSS, summarize
from model.sharding_hooks import constrain

ACTIVATION_AXES = ("batch", "length", "embed")
STACKED = "blocks"  # the parameters stacked on a leading `layers` axis, which pipelines split into stages

CHECKPOINT_POLICIES = {  # model.remat: what the backward pass keeps rather than recomputes
    "full": None,  # nothing: the whole block is recomputed
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the weight matmuls' outputs
    "save_attention": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT),  # attention's output
    # attention's output, moved to host memory until the backward pass needs it
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[ATTENTION_OUT],
        offload_src="device", offload_dst="pinned_host"),
}


class MoeUnit(nnx.Module):
  """moe_every consecutive blocks, the last with a mixture-of-experts feed-forward layer.

  Scanning wants identical units, so a model that alternates dense and MoE
  layers scans over these pairs (or k-tuples) rather than over single blocks.
  """

  def __init__(self, block_class, cfg: ModelConfig, rngs: nnx.Rngs):
    self.layers = nnx.List([block_class(cfg, rngs, moe=i == cfg.moe_every - 1) for i in range(cfg.moe_every)])

  def __call__(self, x_BTD, positions_T):
    for layer in self.layers:
      x_BTD, stats = layer(x_BTD, positions_T)
    return x_BTD, stats  # the last layer's: the MoE one


def stacked(block_class, cfg: ModelConfig, rngs: nnx.Rngs):
  """One unit (a block, or a MoeUnit) whose every parameter has a leading `layers` axis of size num_units."""

  @nnx.split_rngs(splits=cfg.num_units)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return MoeUnit(block_class, cfg, rngs) if cfg.num_experts else block_class(cfg, rngs)

  return make(rngs)


def scan_blocks(blocks, x_BTD, positions_T, cfg: ModelConfig):
  """Run the stacked units in order with nnx.scan, under the configured remat policy.

  Returns the output and each unit's router statistics stacked on a leading axis ({} when dense).
  """

  def apply_block(x_BTD, block, positions_T):
    x_BTD, stats = block(x_BTD, positions_T)
    return constrain(x_BTD, ACTIVATION_AXES), stats

  if cfg.remat != "none":
    apply_block = nnx.remat(apply_block, policy=CHECKPOINT_POLICIES[cfg.remat], prevent_cse=False)
  return nnx.scan(apply_block, in_axes=(nnx.Carry, 0, None), out_axes=(nnx.Carry, 0))(x_BTD, blocks, positions_T)


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
    """The stack's output and its router statistics (model/moe.py `summarize`; {} when dense)."""
    positions_T = jnp.arange(x_BTD.shape[1]) if positions_T is None else positions_T
    x_BTD, stats = scan_blocks(self.blocks, x_BTD, positions_T, self.cfg)
    return x_BTD, summarize(stats)

  def predict(self, tokens_BT):
    """Float32 next-token logits for every position of in-order tokens."""
    return self.logits(self.run_blocks(self.embed_tokens(tokens_BT))[0])

  def head_loss(self, x_BTD, targets_BT):
    return cross_entropy(self.logits(x_BTD), targets_BT)

  def objective(self, tokens_BT, targets_BT, positions_T=None):
    """(cross-entropy + auxiliary losses, statistics): what training differentiates and logs."""
    positions_T = jnp.arange(tokens_BT.shape[1]) if positions_T is None else positions_T
    x_BTD, stats = self.run_blocks(self.embed_tokens(tokens_BT, positions_T), positions_T)
    loss = self.head_loss(x_BTD, targets_BT)
    return loss + stats.get(AUX_LOSS, 0.0), {"cross_entropy": loss, **stats}

  def __call__(self, tokens_BT, targets_BT, positions_T=None):
    """The next-token cross-entropy (what evaluation reports)."""
    return self.objective(tokens_BT, targets_BT, positions_T)[1]["cross_entropy"]
