"""Causal self-attention kernels. The config picks one; the call is the same."""

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import INIT_STD, matmul, param, zeros
from model.sharding_hooks import constrain


def causal_attention(q_BTNH, k_BSNH, v_BSNH, implementation: str) -> jax.Array:
  """Softmax(QK^T/sqrt(H)) V under a causal mask, for query and key length equal."""
  if implementation == "cudnn":
    return jax.nn.dot_product_attention(q_BTNH, k_BSNH, v_BSNH, is_causal=True, implementation="cudnn")
  return _xla_attention(q_BTNH, k_BSNH, v_BSNH)


def _xla_attention(q_BTNH, k_BSNH, v_BSNH) -> jax.Array:
  head_dim = q_BTNH.shape[-1]
  logits_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH, preferred_element_type=jnp.float32)
  logits_BNTS = logits_BNTS * (head_dim ** -0.5)
  t, s = logits_BNTS.shape[-2:]
  causal_TS = jnp.tril(jnp.ones((t, s), bool))
  # The softmax runs in float32 whatever the compute dtype: bf16 exponentials lose the tail.
  logits_BNTS = jnp.where(causal_TS, logits_BNTS, jnp.finfo(jnp.float32).min)
  probs_BNTS = jax.nn.softmax(logits_BNTS, axis=-1).astype(v_BSNH.dtype)
  return jnp.einsum("bnts,bsnh->btnh", probs_BNTS, v_BSNH)


class SelfAttention(nnx.Module):
  """Multi-head attention: fused QKV projection (column parallel), output projection (row parallel)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, h = cfg.embed_dim, cfg.num_heads, cfg.head_dim
    self.qkv_kernel = param(rngs, (d, 3, n, h), ("embed", None, "heads", "head_dim"))
    self.qkv_bias = zeros((3, n, h), (None, "heads", "head_dim"))
    # GPT-2 scales residual projections by 1/sqrt(2L) so the residual stream's variance stays put.
    self.out_kernel = param(rngs, (n, h, d), ("heads", "head_dim", "embed"),
                            std=INIT_STD / (2 * cfg.num_layers) ** 0.5)
    self.out_bias = zeros((d,), ("embed",))
    self.cfg = cfg

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    dtype = self.cfg.dtype
    qkv_BT3NH = matmul("btd,dcnh->btcnh", x_BTD, self.qkv_kernel[...], dtype)
    qkv_BT3NH = qkv_BT3NH + self.qkv_bias[...].astype(dtype)
    q_BTNH, k_BTNH, v_BTNH = (
        constrain(qkv_BT3NH[:, :, i], ("batch", "length", "heads", "head_dim")) for i in range(3))
    out_BTNH = causal_attention(q_BTNH, k_BTNH, v_BTNH, self.cfg.attention)
    out_BTD = matmul("btnh,nhd->btd", out_BTNH, self.out_kernel[...], dtype)
    return out_BTD + self.out_bias[...].astype(dtype)
