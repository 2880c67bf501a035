"""A short text sample from the current parameters (the closing line of a run)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from training.state import Layout


def generate(layout: Layout, params, prompt_ids, *, num_tokens: int, temperature: float = 0.8,
             seed: int = 0) -> np.ndarray:
  """Autoregressive sampling over a fixed window of max_len tokens, one compiled forward reused."""
  window = layout.model.max_len

  @jax.jit
  def next_token(params, tokens_1T, position, key):
    model = nnx.merge(layout.graphdef, params)
    logits_1TV = model.predict(tokens_1T)
    return jax.random.categorical(key, logits_1TV[0, position] / temperature)

  ids = list(prompt_ids)[-window:] or [0]
  key = jax.random.key(seed)
  for _ in range(num_tokens):
    context = ids[-window:]
    tokens_1T = np.zeros((1, window), np.int32)
    tokens_1T[0, :len(context)] = context  # causal attention: the zero padding after it is never seen
    key, sub = jax.random.split(key)
    ids.append(int(next_token(params, tokens_1T, len(context) - 1, sub)))
  return np.asarray(ids[len(prompt_ids):])
