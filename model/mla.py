"""Multi-head latent attention (DeepSeek-AI, "DeepSeek-V2", 2024; used unchanged by DeepSeek-V3).

Keys and values come from one low-rank latent per token: x -> c (model.mla_kv_rank wide, RMS-normalised) ->
each head's key part without positions and its value. Beside the latent, x gives one rotary key of
model.mla_rope_dim shared by every head. Queries come straight from x, or through a latent of their own
(model.mla_q_rank > 0, RMS-normalised, as DeepSeek-V3's). A query head is [no-position part, rotary part],
head_width wide, and so is a key head, the shared rotary key appended to each head's own part; values are
model.mla_v_dim wide. Decoding caches only the latent and the rotary key: kv_rank + rope_dim numbers per token
and layer, against 2 x kv_heads x head_width for grouped-query attention (docs/long_context.md).

Under tensor parallelism the latents' projections are replicated (each device makes the whole latent, which is
small) and the per-head up-projections and the output split by head, as Megatron-LM splits MLA. Every
attention kernel and context strategy takes the keys and values as ordinary heads; values narrower than the
keys are padded with zeros to the key width for the kernel and cut back after it.
"""

import jax.numpy as jnp
from flax import nnx

from model.attention import attention, blockwise_attention
from model.config import ModelConfig
from model.layers import RMSNorm, matmul, out_projection_std, param
from model.placement import constrain
from model.rotary import rotary

LATENT_CACHE_AXES = ("batch", "length", None, None)  # [B, S, 1, latent or rotary key]: one shared "head"


class LatentAttention(nnx.Module):
  """Multi-head latent attention: N heads of head_width (queries, keys), values mla_v_dim wide.

  The weights are laid out as DeepSeek's checkpoints hold them, so an import only reshapes: the latent's
  down-projection and the rotary key's are one kernel (kv_rank + rope_dim wide), as are each head's key and
  value up-projections (no-position key part + v_dim), and the rotary dimensions come in adjacent pairs.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, h, r, c, v = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mla_rope_dim, cfg.mla_kv_rank, cfg.mla_v_dim
    if cfg.mla_q_rank:
      self.q_down_kernel = param(rngs, (d, cfg.mla_q_rank), ("embed", "latent"))
      self.q_norm = RMSNorm(cfg.mla_q_rank, cfg.epsilon, axis="latent")
    q_input = "latent" if cfg.mla_q_rank else "embed"
    self.q_kernel = param(rngs, (cfg.mla_q_rank or d, n, h), (q_input, "heads", "head_dim"))
    self.kv_down_kernel = param(rngs, (d, c + r), ("embed", "latent"))
    self.kv_norm = RMSNorm(c, cfg.epsilon, axis="latent")
    self.kv_up_kernel = param(rngs, (c, n, h - r + v), ("latent", "heads", "head_dim"))
    self.out_kernel = param(rngs, (n, v, d), ("heads", "head_dim", "embed"),
                            std=out_projection_std(cfg))
    self.cfg = cfg

  def queries(self, x_BTD, positions_T):
    """[B, T, N, head_width], the last mla_rope_dim of each head rotated."""
    cfg = self.cfg
    if cfg.mla_q_rank:
      x_BTD = self.q_norm(matmul("btd,dq->btq", x_BTD, self.q_down_kernel[...], cfg.dtype, cfg.fp8))
    q_BTNH = matmul("btq,qnh->btnh", x_BTD, self.q_kernel[...], cfg.dtype, cfg.fp8)
    if cfg.mla_score_scale != 1.0:  # every score scaled: DeepSeek's YaRN mscale_all_dim
      q_BTNH = q_BTNH * jnp.asarray(cfg.mla_score_scale, q_BTNH.dtype)
    nope = cfg.head_dim - cfg.mla_rope_dim
    return jnp.concatenate([q_BTNH[..., :nope], rotary(q_BTNH[..., nope:], positions_T, cfg, adjacent=True)], -1)

  def latent(self, x_BTD, positions_T):
    """The normalised latent c [B, T, kv_rank] and the rotary key [B, T, 1, rope_dim]: all a cache keeps."""
    cfg = self.cfg
    down_BTX = matmul("btd,dx->btx", x_BTD, self.kv_down_kernel[...], cfg.dtype, cfg.fp8)
    latent_BTC, k_rope_BT1R = down_BTX[..., :cfg.mla_kv_rank], down_BTX[:, :, None, cfg.mla_kv_rank:]
    return self.kv_norm(latent_BTC), rotary(k_rope_BT1R, positions_T, cfg, adjacent=True)

  def keys_values(self, latent_BSC, k_rope_BS1R):
    """Every head's keys [B, S, N, head_width] and values [B, S, N, v_dim] from the latent and the rotary key."""
    cfg = self.cfg
    up_BSNX = matmul("bsc,cnx->bsnx", latent_BSC, self.kv_up_kernel[...], cfg.dtype, cfg.fp8)
    nope = cfg.head_dim - cfg.mla_rope_dim
    k_rope_BSNR = jnp.broadcast_to(k_rope_BS1R, (*up_BSNX.shape[:3], cfg.mla_rope_dim)).astype(up_BSNX.dtype)
    return jnp.concatenate([up_BSNX[..., :nope], k_rope_BSNR], axis=-1), up_BSNX[..., nope:]

  def __call__(self, x_BTD, positions_T, segments_BT=None, cache=None, global_layer=None, value_embed=None):
    del value_embed  # model/config.py refuses value embeddings with latent attention: its values come from a latent
    cfg, heads = self.cfg, ("batch", "length", "heads", "head_dim")
    q_BTNH = constrain(self.queries(x_BTD, positions_T), heads)
    latent_BTC, k_rope_BT1R = self.latent(x_BTD, positions_T)
    if cache is not None:  # decoding: the cache holds latents and rotary keys; each step expands all of them
      cache.write(positions_T, latent_BTC[:, :, None], k_rope_BT1R, LATENT_CACHE_AXES)
      k_BSNH, v_BSNV = self.keys_values(cache.k_BSKH[:, :, 0], cache.v_BSKH)
    else:
      k_BSNH, v_BSNV = self.keys_values(latent_BTC, k_rope_BT1R)
    pad = cfg.head_dim - cfg.mla_v_dim  # every kernel takes values as wide as keys
    v_BSNH = constrain(jnp.pad(v_BSNV, ((0, 0), (0, 0), (0, 0), (0, pad))), heads)
    k_BSNH = constrain(k_BSNH, heads)
    if cache is not None:
      out_BTNH, _ = blockwise_attention(q_BTNH, k_BSNH, v_BSNH, positions_T, jnp.arange(k_BSNH.shape[1]),
                                        cfg.attention_block, softcap=cfg.attention_softcap)
    else:
      out_BTNH = attention(q_BTNH, k_BSNH, v_BSNH, positions_T, cfg, segments_BT, None, global_layer)
    return matmul("btnv,nvd->btd", out_BTNH[..., :cfg.mla_v_dim], self.out_kernel[...], cfg.dtype, cfg.fp8)


def attention_layer(cfg: ModelConfig, rngs: nnx.Rngs, ordinary_class) -> nnx.Module:
  """A block's attention: latent attention where model.mla_kv_rank is set, else the family's `ordinary_class`."""
  return LatentAttention(cfg, rngs) if cfg.mla_kv_rank else ordinary_class(cfg, rngs)
