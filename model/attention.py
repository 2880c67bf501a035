"""Causal self-attention: the kernels, the one call the model makes, and GPT-2's attention layer."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from model.config import ModelConfig
from model.layers import INIT_STD, matmul, param, zeros
from model.sharding_hooks import attention_strategy, constrain


ATTENTION_OUT = "attention_out"  # the name remat policies save or offload (model/transformer.py)


def attention(q_BTNH, k_BSKH, v_BSKH, positions_T, kernel: str) -> jax.Array:
  """Causal attention by token position, with K <= N key/value heads (grouped-query).

  Positions, not array order, decide what each query may see: a context
  strategy may reorder the sequence (zig-zag ring attention) and shard it.
  """
  strategy = attention_strategy()
  if strategy is None:
    out_BTNH = local_attention(q_BTNH, k_BSKH, v_BSKH, positions_T, positions_T, kernel=kernel)
  else:
    out_BTNH = strategy(q_BTNH, k_BSKH, v_BSKH, positions_T)
  return checkpoint_name(out_BTNH, ATTENTION_OUT)


def local_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S, *, kernel: str) -> jax.Array:
  """Attention of local queries over local keys; `kernel` is xla or cudnn."""
  if kernel == "cudnn":
    # cuDNN's causal mask is by index: right when queries and keys are the same contiguous run.
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True, implementation="cudnn")
  out_BTNH, _, _ = attention_block(q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S)
  return out_BTNH


def attention_block(q_BTNH, k_BSKH, v_BSKH, q_positions_T, k_positions_S):
  """Normalised attention of one query block over one key block, with its softmax statistics.

  Returns (out, row max, row sum of exponentials) so a ring can merge blocks
  with an online softmax. Everything after the QK product is float32.
  """
  b, t, n, h = q_BTNH.shape
  kv_heads = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, kv_heads, n // kv_heads, h)
  logits_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  logits_BKGTS = logits_BKGTS * (h ** -0.5)
  visible_TS = k_positions_S[None, :] <= q_positions_T[:, None]
  logits_BKGTS = jnp.where(visible_TS, logits_BKGTS, jnp.finfo(jnp.float32).min)
  max_BKGT = logits_BKGTS.max(-1)
  exp_BKGTS = jnp.where(visible_TS, jnp.exp(logits_BKGTS - max_BKGT[..., None]), 0.0)
  sum_BKGT = exp_BKGTS.sum(-1)
  probs_BKGTS = (exp_BKGTS / jnp.maximum(sum_BKGT, 1e-30)[..., None]).astype(v_BSKH.dtype)
  out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(b, t, n, h), max_BKGT, sum_BKGT


class SelfAttention(nnx.Module):
  """GPT-2 attention: fused QKV projection (column parallel), output projection (row parallel)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, h = cfg.embed_dim, cfg.num_heads, cfg.head_dim
    self.qkv_kernel = param(rngs, (d, 3, n, h), ("embed", None, "heads", "head_dim"))
    self.qkv_bias = zeros((3, n, h), (None, "heads", "head_dim"))
    # GPT-2 scales residual projections by 1/sqrt(2L) so the residual stream's variance stays put.
    self.out_kernel = param(rngs, (n, h, d), ("heads", "head_dim", "embed"),
                            std=INIT_STD / (2 * cfg.num_layers) ** 0.5)
    self.out_bias = zeros((d,), ("embed",))
    self.cfg = cfg

  def __call__(self, x_BTD: jax.Array, positions_T: jax.Array) -> jax.Array:
    dtype = self.cfg.dtype
    qkv_BT3NH = matmul("btd,dcnh->btcnh", x_BTD, self.qkv_kernel[...], dtype, self.cfg.fp8)
    qkv_BT3NH = qkv_BT3NH + self.qkv_bias[...].astype(dtype)
    q_BTNH, k_BTNH, v_BTNH = (
        constrain(qkv_BT3NH[:, :, i], ("batch", "length", "heads", "head_dim")) for i in range(3))
    out_BTNH = attention(q_BTNH, k_BTNH, v_BTNH, positions_T, self.cfg.attention)
    out_BTD = matmul("btnh,nhd->btd", out_BTNH, self.out_kernel[...], dtype, self.cfg.fp8)
    return out_BTD + self.out_bias[...].astype(dtype)
