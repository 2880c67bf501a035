"""Multi-token prediction (DeepSeek-V3, section 2.2): D modules after the stack, module k predicting token i+k+1.

Module k takes the hidden state at each position i that module k-1 left (the stack's output for k = 1) and the
embedding of token i+k, normalises each (RMSNorm), projects the pair back to the model's width and runs one
block of the family with a dense feed-forward layer; the model's own final norm and head then score token
i+k+1. Training adds model.mtp_weight times the modules' mean cross-entropy to the objective, each module's
loss over the positions whose target lies inside the sequence. Decoding, evaluation and export read the stack
alone: the modules only shape what the stack learns (DeepSeek-V3 also drafts tokens with them when serving).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import RMSNorm, matmul, param
from model.stack import CHECKPOINT_POLICIES, dense_layers_config, stack_of

MTP = "mtp"  # the modules' parameters, stacked on a leading `layers` axis of model.mtp_depth
LOSS = "mtp_cross_entropy"  # the modules' mean cross-entropy, among the step's statistics


def module_config(cfg: ModelConfig) -> ModelConfig:
  """The config a module's block runs with: a dense feed-forward layer (moe.first_dense's width where set), and
  the stack's window for every module where layers alternate (model.global_every)."""
  return dataclasses.replace(dense_layers_config(cfg), global_every=0, local_rope_theta=0.0)


class PredictionModule(nnx.Module):
  """One depth of multi-token prediction: the merge of a hidden state with a later token's embedding, and a block."""

  def __init__(self, block_class, cfg: ModelConfig, rngs: nnx.Rngs):
    d = cfg.embed_dim
    self.token_norm = RMSNorm(d, cfg.epsilon)
    self.hidden_norm = RMSNorm(d, cfg.epsilon)
    # The token's half, then the hidden state's, as DeepSeek's eh_proj reads their concatenation. `embed` on both
    # sides: a spec uses a mesh axis once, so ZeRO-3 splits the input side and the output side stays whole.
    self.merge_kernel = param(rngs, (2, d, d), (None, "embed", "embed"))
    self.block = block_class(module_config(cfg), rngs)
    self.cfg = cfg

  def __call__(self, hidden_BTD, embedded_BTD, positions_T, segments_BT=None):
    cfg, kernel = self.cfg, self.merge_kernel[...]
    merged_BTD = (matmul("btd,de->bte", self.token_norm(embedded_BTD), kernel[0], cfg.dtype, cfg.fp8)
                  + matmul("btd,de->bte", self.hidden_norm(hidden_BTD), kernel[1], cfg.dtype, cfg.fp8))
    return self.block(merged_BTD, positions_T, segments_BT)[0]


def prediction_modules(block_class, cfg: ModelConfig, rngs: nnx.Rngs):
  """model.mtp_depth modules, their parameters stacked on a leading `layers` axis."""
  return stack_of(lambda rngs: PredictionModule(block_class, cfg, rngs), rngs, cfg.mtp_depth)


def ahead(x_BT, k: int, positions_T):
  """Each place's entry k tokens later in token order, for a sequence laid out in `positions_T`'s order (a
  context strategy's); the last token's where that lies past the end (prediction_loss leaves those out)."""
  last = x_BT.shape[1] - 1
  return x_BT[:, jnp.argsort(positions_T)[jnp.minimum(positions_T + k, last)]]


def prediction_loss(model, hidden_BTD, targets_BT, positions_T, segments_BT, embed_positions, weights_BT=None):
  """The modules' mean cross-entropy, module k's over the positions i with i+k+1 inside the sequence.

  `targets_BT` holds token i+1 at position i, so module k reads the embedding of targets k-1 ahead and scores
  targets k ahead. With per-token `weights_BT` (fine-tuning on completions) a position counts as much as the
  token it predicts would. Each module's loss is divided by the share of positions it scores, so a module's
  figure is a mean over its positions, as the stack's is.
  """
  cfg, length = model.cfg, targets_BT.shape[1]
  graphdef, stack = nnx.split(getattr(model, MTP))
  run = lambda module, hidden_BTD, embedded_BTD: module(hidden_BTD, embedded_BTD, positions_T, segments_BT)
  if cfg.remat != "none":
    run = nnx.remat(run, policy=CHECKPOINT_POLICIES[cfg.remat], prevent_cse=False)
  weights_BT = jnp.ones(targets_BT.shape, jnp.float32) if weights_BT is None else weights_BT
  losses = []
  for k in range(1, cfg.mtp_depth + 1):
    module = nnx.merge(graphdef, jax.tree.map(lambda p: p[k - 1], stack))
    embedded_BTD = model.embed_tokens(ahead(targets_BT, k - 1, positions_T), embed_positions)
    hidden_BTD = run(module, hidden_BTD, embedded_BTD)
    scored_BT = ahead(weights_BT, k, positions_T) * (positions_T + k < length)
    loss = model.head_loss(hidden_BTD, ahead(targets_BT, k, positions_T), scored_BT)
    losses.append(loss * length / (length - k))
  return sum(losses) / cfg.mtp_depth
