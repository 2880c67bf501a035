"""OLMoE: Llama's decoder with queries and keys RMS-normalised over their whole width, before rotary.

OLMoE (Muennighoff et al., "OLMoE: Open Mixture-of-Experts Language Models", 2024) normalises the
query projection over all its heads at once (one gain per heads x head_dim element), and the key
projection likewise over its key/value heads, where Qwen3 normalises each head on its own
(model/qwen.py). Its feed-forward layers are mixtures of experts (config.moe, every layer, top-k of
the softmax without renormalising); everything else is model/llama.py's.
"""

from flax import nnx

from model import llama
from model.config import ModelConfig
from model.layers import ones, rms_norm


class WidthNorm(nnx.Module):
  """RMSNorm over the last two axes together (heads x head_dim), in float32."""

  def __init__(self, heads: int, head_dim: int, eps: float, heads_axis: str):
    self.scale = ones((heads, head_dim), (heads_axis, "head_dim"))
    self.eps = eps

  def __call__(self, x_BTNH):
    return rms_norm(x_BTNH, self.scale[...], self.eps)  # the scale's two axes are the ones normalised


class Attention(llama.Attention):
  """llama.Attention with the query and key projections normalised over their whole width."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    super().__init__(cfg, rngs)
    self.q_norm = WidthNorm(cfg.num_heads, cfg.head_dim, cfg.epsilon, "heads")
    self.k_norm = WidthNorm(cfg.num_kv_heads, cfg.head_dim, cfg.epsilon, "kv_heads")

  def project(self, x_BTD):
    q_BTNH, k_BTKH, v_BTKH = super().project(x_BTD)
    return self.q_norm(q_BTNH), self.k_norm(k_BTKH), v_BTKH


class Block(llama.Block):
  attention_class = Attention


class OLMoE(llama.Llama):
  block_class = Block
