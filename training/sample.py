"""Text generation with a key/value cache, compiled once, on the run's mesh.

The prompt is prefilled in one forward pass that fills the cache, then each
new token is one forward pass over a single position inside a `lax.scan`, so
generating N tokens compiles one program and recomputes nothing.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.kv_cache import forward_cached, init_cache
from model.placement import placed
from parallel import placement, rules
from parallel.mesh import DATA, EXPERT
from training.state import Layout


def encode_prompt(tokenizer, text: str) -> np.ndarray:
  """The prompt's tokens; an empty prompt starts a fresh document after the separator token."""
  ids = tokenizer.encode(text)
  return ids if len(ids) else np.asarray([tokenizer.end_of_text], np.int32)


def check_request(max_len: int, prompt_len: int, num_tokens: int, temperature: float, top_k: int,
                  vocab_size: int, top_p: float = 1.0) -> None:
  """Refuse a request the cache or the sampler cannot serve, in one sentence."""
  if prompt_len + num_tokens > max_len:
    raise ValueError(f"a prompt of {prompt_len} tokens plus {num_tokens} new tokens exceeds the model's "
                     f"context of model.max_len={max_len}; shorten the prompt or ask for fewer tokens.")
  if num_tokens < 1:
    raise ValueError(f"the number of tokens to generate must be at least 1, got {num_tokens}.")
  if temperature < 0:
    raise ValueError(f"temperature={temperature} is negative; use 0 for greedy decoding or a positive value.")
  if not 0 <= top_k <= vocab_size:
    raise ValueError(f"top_k={top_k} is outside 0..{vocab_size} (0 keeps the whole vocabulary).")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} is outside (0, 1] (1 keeps the whole vocabulary).")


def _pick(logits_BV, key, temperature, top_k, top_p):
  """Greedy at temperature 0, else a sample over temperature from the top-k logits (all when k = 0), cut to the
  fewest most likely tokens whose probabilities reach top_p (all when top_p = 1).

  Every setting is a traced value, so one compiled sampler serves every setting.
  """
  vocab = logits_BV.shape[-1]
  sorted_BV = jnp.sort(logits_BV, axis=-1)
  kth_B1 = jnp.where(top_k > 0, sorted_BV[:, jnp.clip(vocab - top_k, 0, vocab - 1)][:, None], -jnp.inf)
  scaled_BV = jnp.where(logits_BV >= kth_B1, logits_BV / jnp.maximum(temperature, 1e-6), -jnp.inf)
  # The nucleus: a token stays while the tokens more likely than it hold less than top_p of the probability.
  # Scaling keeps the logits' order, so the sort above serves, reversed.
  descending_BV = jnp.where(sorted_BV >= kth_B1, sorted_BV / jnp.maximum(temperature, 1e-6), -jnp.inf)[:, ::-1]
  probs_BV = jax.nn.softmax(descending_BV, axis=-1)
  kept_B = jnp.maximum((jnp.cumsum(probs_BV, axis=-1) - probs_BV < top_p).sum(-1), 1)
  floor_B1 = jnp.where(top_p < 1, jnp.take_along_axis(descending_BV, kept_B[:, None] - 1, axis=-1), -jnp.inf)
  sampled_B = jax.random.categorical(key, jnp.where(scaled_BV >= floor_B1, scaled_BV, -jnp.inf), axis=-1)
  return jnp.where(temperature > 0, sampled_B, jnp.argmax(logits_BV, axis=-1)).astype(jnp.int32)


def make_sampler(layout: Layout, *, batch: int, prompt_len: int, num_tokens: int, keep_logits: bool = False):
  """A jitted (params, prompt_BP, key, temperature, top_k, top_p) -> (tokens_BN, logits_BNV or None) for these
  sizes."""
  cfg = layout.model
  decoding = placement.for_decoding(layout)

  def run(params, prompt_BP, key, temperature, top_k, top_p):
    with placed(decoding):
      model = nnx.merge(layout.graphdef, params)
      logits_BPV, cache = forward_cached(model, prompt_BP, jnp.arange(prompt_len), init_cache(cfg, batch))
      first_BV = logits_BPV[:, -1]
      first_B = _pick(first_BV, jax.random.fold_in(key, 0), temperature, top_k, top_p)

      def step(carry, i):
        token_B, cache = carry
        # A module made outside the scan may not be used in its body (nnx checks trace levels).
        model = nnx.merge(layout.graphdef, params)
        logits_B1V, cache = forward_cached(model, token_B[:, None], (prompt_len + i)[None], cache)
        logits_BV = logits_B1V[:, 0]
        next_B = _pick(logits_BV, jax.random.fold_in(key, i + 1), temperature, top_k, top_p)
        return (next_B, cache), (next_B, logits_BV if keep_logits else None)

      _, (rest_NB, rest_NBV) = jax.lax.scan(step, (first_B, cache), jnp.arange(num_tokens - 1))
      tokens_BN = jnp.concatenate([first_B[:, None], rest_NB.T], axis=1)
      if not keep_logits:
        return tokens_BN, None
      return tokens_BN, jnp.concatenate([first_BV[:, None], jnp.swapaxes(rest_NBV, 0, 1)], axis=1)

  prompt_sharding = rules.named(layout.mesh, "batch", None)
  replicated = layout.replicated()
  return jax.jit(run, in_shardings=(layout.param_shardings, prompt_sharding, *[replicated] * 4),
                 out_shardings=replicated)


def decode_batch(layout: Layout, num_samples: int) -> int:
  """The decoded batch: `num_samples` rounded up to a multiple of the data-parallel degree."""
  parallel = layout.mesh.shape[DATA] * layout.mesh.shape[EXPERT]
  return math.ceil(num_samples / parallel) * parallel


def generate(layout: Layout, params, prompt_ids, *, num_tokens: int, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0, num_samples: int = 1, keep_logits: bool = False):
  """`num_samples` continuations of one prompt: tokens [num_samples, num_tokens] (and their logits)."""
  prompt_ids = np.asarray(prompt_ids, np.int32)
  if num_samples < 1:
    raise ValueError(f"num_samples={num_samples} must be at least 1.")
  check_request(layout.model.max_len, len(prompt_ids), num_tokens, temperature, top_k,
                layout.model.vocab_size)
  batch = decode_batch(layout, num_samples)
  sampler = make_sampler(layout, batch=batch, prompt_len=len(prompt_ids), num_tokens=num_tokens,
                         keep_logits=keep_logits)
  tokens_BN, logits_BNV = jax.device_get(sampler(params, np.tile(prompt_ids, (batch, 1)), jax.random.key(seed),
                                                 np.float32(temperature), np.int32(top_k), np.float32(1)))
  if keep_logits:
    return tokens_BN[:num_samples], logits_BNV[:num_samples]
  return tokens_BN[:num_samples]
