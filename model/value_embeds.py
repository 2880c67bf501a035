"""Value embeddings (model.value_embeds; the modded-nanogpt speedrun's): k token tables as wide as a layer's values.
Layer i < k mixes table i's rows for its tokens into its values, and so does layer L-k+i: v <- a v + b e, a and b
the layer's own, starting at 1/2 each. A token's identity then reaches the values of the first and last layers
directly, not through the residual stream.

The model looks the tables up once per step (LanguageModel.value_rows), outside the scanned stack; each unit of the
scan gets its table's index as a per-unit kind (`value_table`, -1 for none), and `block_kinds` turns it into the
block's `value_embed`: that table's rows and whether the layer has one. Layers without a table keep their values.
"""

import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig

VALUE_EMBEDS = "value_embeds"  # the model's attribute holding the tables [k, vocab, kv_heads, head_dim]
TABLE = "value_table"  # the per-unit kind naming each layer's table


def layer_tables(cfg: ModelConfig) -> tuple[int, ...]:
  """Each layer's table, -1 for none: tables 0..k-1 for the first k layers, and again for the last k."""
  k, last = cfg.value_embeds, cfg.num_layers - cfg.value_embeds
  return tuple(i if i < k else i - last if i >= last else -1 for i in range(cfg.num_layers))


def block_kinds(kinds: dict, rows_kBTKH) -> dict:
  """A block's keyword arguments from its unit's kinds: the table's index replaced by `value_embed`, (that table's
  rows [B, T, K, H], whether the layer has a table); without rows (a caller that runs no tokens) the index goes."""
  if TABLE not in kinds:
    return kinds
  kinds = dict(kinds)
  table = kinds.pop(TABLE)
  if rows_kBTKH is None:
    return kinds
  return {**kinds, "value_embed": (rows_kBTKH[jnp.maximum(table, 0)], table >= 0)}


class ValueMix(nnx.Module):
  """A layer's two weights (a, b) in v <- a v + b e, each starting at 1/2 (a vector: no decay, AdamW under Muon)."""

  def __init__(self):
    self.scale = nnx.Param(jnp.full((2,), 0.5, jnp.float32), out_sharding=(None,))

  def __call__(self, v_BTKH, value_embed):
    rows_BTKH, present = value_embed
    a, b = self.scale[...]
    return jnp.where(present, (a * v_BTKH + b * rows_BTKH).astype(v_BTKH.dtype), v_BTKH)


def mixed_values(attention: nnx.Module, v_BTKH, value_embed):
  """The attention layer's values with its table's rows mixed in (its `value_mix`, a ValueMix it holds where
  model.value_embeds is set); as they are where it is given none."""
  return v_BTKH if value_embed is None else attention.value_mix(v_BTKH, value_embed)
