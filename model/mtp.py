"""Multi-token prediction (DeepSeek-V3, section 2.2): D modules after the stack, module k predicting token i+k+1.

Module k takes the hidden state at each position i that module k-1 left (for k = 1, the stack's output after the
model's final norm) and the embedding of token i+k, normalises each (RMSNorm), projects the pair back to the
model's width, runs one block of the family (routed where the model routes) and normalises its output with a
norm of its own; the model's head then scores token i+k+1. The layout is DeepSeek-V3's checkpoint's, which
transformers' MtpModel reads (modeling_layers.py). Training adds model.mtp_weight times the modules' mean
cross-entropy to the objective, each module's loss over the positions whose target lies inside the sequence.
Decoding and evaluation read the stack alone: the modules shape what it learns (and can draft tokens when
serving, which meshlm does not do).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import RMSNorm, matmul, param
from model.moe import summarize
from model.stack import CHECKPOINT_POLICIES, stack_of, unit_of

MTP = "mtp"  # the modules' parameters, stacked on a leading `layers` axis of model.mtp_depth
LOSS = "mtp_cross_entropy"  # the modules' mean cross-entropy, among the step's statistics
LOADS = "mtp_expert_load_by_module"  # each routed module's expert loads, what moves its router bias (moe.bias_rate)


def module_config(cfg: ModelConfig) -> ModelConfig:
  """The config a module's block runs with: the stack's window for every module where layers alternate
  (model.global_every); experts as the routed layers have them."""
  return dataclasses.replace(cfg, global_every=0, local_rope_theta=0.0)


class PredictionModule(nnx.Module):
  """One depth of multi-token prediction: the merge of a hidden state with a later token's embedding, a block and
  its output norm (DeepSeek-V3's enorm, hnorm, eh_proj, the layer, shared_head.norm)."""

  def __init__(self, block_class, cfg: ModelConfig, rngs: nnx.Rngs):
    d = cfg.embed_dim
    self.token_norm = RMSNorm(d, cfg.epsilon)
    self.hidden_norm = RMSNorm(d, cfg.epsilon)
    # The token's half, then the hidden state's, as eh_proj reads their concatenation. `embed` on both sides: a
    # spec uses a mesh axis once, so ZeRO-3 splits the input side and the output side stays whole.
    self.merge_kernel = param(rngs, (2, d, d), (None, "embed", "embed"))
    self.block = block_class(module_config(cfg), rngs, moe=bool(cfg.num_experts))
    self.output_norm = RMSNorm(d, cfg.epsilon)
    self.cfg = cfg

  def __call__(self, hidden_BTD, embedded_BTD, positions_T, segments_BT=None):
    """(the normalised output, the block's router statistics)."""
    cfg, kernel = self.cfg, self.merge_kernel[...]
    merged_BTD = (matmul("btd,de->bte", self.token_norm(embedded_BTD), kernel[0], cfg.dtype, cfg.fp8)
                  + matmul("btd,de->bte", self.hidden_norm(hidden_BTD), kernel[1], cfg.dtype, cfg.fp8))
    out_BTD, stats = self.block(merged_BTD, positions_T, segments_BT)
    return self.output_norm(out_BTD), stats


def prediction_modules(block_class, cfg: ModelConfig, rngs: nnx.Rngs):
  """model.mtp_depth modules, their parameters stacked on a leading `layers` axis."""
  return stack_of(lambda rngs: PredictionModule(block_class, cfg, rngs), rngs, cfg.mtp_depth)


def ahead(x_BT, k: int, positions_T):
  """Each place's entry k tokens later in token order, for a sequence laid out in `positions_T`'s order (a
  context strategy's); the last token's where that lies past the end (prediction_loss leaves those out)."""
  last = x_BT.shape[1] - 1
  return x_BT[:, jnp.argsort(positions_T)[jnp.minimum(positions_T + k, last)]]


def prediction_loss(model, hidden_BTD, targets_BT, positions_T, segments_BT, embed_positions, weights_BT=None):
  """(the modules' mean cross-entropy, their router statistics as model/moe.py `summarize` gives them ({} when
  dense)); module k's loss is over the positions i with i+k+1 inside the sequence.

  `hidden_BTD` is the stack's output before the final norm. `targets_BT` holds token i+1 at position i, so module
  k reads the embedding of targets k-1 ahead and scores targets k ahead. With per-token `weights_BT`
  (fine-tuning on completions) a position counts as much as the token it predicts would. Each module's loss is
  divided by the share of positions it scores, so a module's figure is a mean over its positions, as the
  stack's is.
  """
  cfg, length = model.cfg, targets_BT.shape[1]
  run = lambda module, hidden_BTD, embedded_BTD: module(hidden_BTD, embedded_BTD, positions_T, segments_BT)
  if cfg.remat != "none":
    run = nnx.remat(run, policy=CHECKPOINT_POLICIES[cfg.remat], prevent_cse=False)
  weights_BT = jnp.ones(targets_BT.shape, jnp.float32) if weights_BT is None else weights_BT
  hidden_BTD, losses, stats = model.final_norm(hidden_BTD), [], []
  for k in range(1, cfg.mtp_depth + 1):
    module = unit_of(getattr(model, MTP), k - 1)
    embedded_BTD = model.embed_tokens(ahead(targets_BT, k - 1, positions_T), embed_positions)
    hidden_BTD, module_stats = run(module, hidden_BTD, embedded_BTD)
    scored_BT = ahead(weights_BT, k, positions_T) * (positions_T + k < length)
    loss = model.head_loss(hidden_BTD, ahead(targets_BT, k, positions_T), scored_BT, normalized=True)
    losses.append(loss * length / (length - k))
    stats.append(module_stats)
  return sum(losses) / cfg.mtp_depth, summarize(jax.tree.map(lambda *per_module: jnp.stack(per_module), *stats))
