"""meshlm as an lm-evaluation-harness model, and the perplexity of a token split.

`MeshlmLM` answers the harness's three kinds of request on the sharded model, as its own Hugging Face
class (`lm_eval.models.huggingface.HFLM`) answers them, so that a task scores the same through either:
- loglikelihood: the harness's `TemplateLM` encodes each (context, continuation) pair (trailing spaces
  moved onto the continuation, the whole encoded and split; an empty context becomes the beginning-of-sequence
  token, or the end-of-text where the tokenizer has none), and the continuation's summed log-probability and whether greedy decoding would give it are
  read off one forward pass of context + continuation, truncated on the left to the model's length;
- loglikelihood_rolling: a text's disjoint rolling windows of the model's length (the harness's
  `get_rolling_token_windows`), each scored as a continuation;
- generate_until: the context (truncated to leave room for `max_gen_toks`) continued by meshlm's
  KV-cache sampler, greedily unless `do_sample`, decoded without special tokens and cut at the first `until`
  string or end-of-text.
Requests run in batches of `batch_size` sorted longest first (the harness's order), right-padded to one
length per batch (a power of two, so few lengths compile); causal attention keeps padding out of every
scored position. Rows are laid out over the mesh as a training batch is.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils
from lm_eval.api.model import TemplateLM

from configs.base import base
from configs.load import set_fields
from input_pipeline.tokenizer import checkpoint_tokenizer
from interop.hf_checkpoint import open_init_from
from model.families import FAMILIES
from model.placement import placed
from parallel import placement
from training.sample import generate
from training.state import Layout, plan

SHORTEST_BATCH_LENGTH = 16


class MeshlmLM(TemplateLM):
  """An lm-evaluation-harness model over meshlm `params` laid out by `layout`, with its run's `tokenizer`."""

  def __init__(self, layout: Layout, params, tokenizer, batch_size: int = 8):
    super().__init__()
    # `tokenizer` stays the harness's (None): its result logger reads a Hugging Face tokenizer's fields there.
    self.layout, self.params, self.text_tokenizer, self.batch_size = layout, params, tokenizer, batch_size
    mesh = layout.batch_sharding.mesh
    self.rows = math.prod(mesh.shape[axis] for axis in _row_axes(layout))  # a batch is a multiple of this

    @jax.jit
    def scored(params, tokens_BL, targets_BL):
      """Each position's log-probability of its target, and whether it is the most likely token: [B, L] each,
      so that only these leave the devices, not a [B, L, vocabulary] array."""
      with placed(placement.for_layout(layout)):
        logits_BLV = nnx.merge(layout.graphdef, params).predict(tokens_BL)
      log_probs_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
      return (jnp.take_along_axis(log_probs_BLV, targets_BL[..., None], axis=-1)[..., 0],
              jnp.argmax(log_probs_BLV, axis=-1) == targets_BL)

    self._scored = scored

  @property
  def eot_token_id(self) -> int:
    return self.text_tokenizer.end_of_text

  @property
  def prefix_token_id(self) -> int:
    """What an empty context becomes: the tokenizer's beginning-of-sequence token, else its end-of-text (HFLM's
    choice)."""
    begin = getattr(self.text_tokenizer, "begin_of_text", None)
    return self.eot_token_id if begin is None else begin

  @property
  def max_length(self) -> int:
    return self.layout.model.max_len

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs  # meshlm's tokenizers add none, as HFLM asks of causal models
    return self.text_tokenizer.encode(string).tolist()

  def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
    """As the harness's Hugging Face class decodes: special tokens left out unless asked for, and ids that are
    no token (a vocabulary padded past the tokenizer's) dropped, as the tokenizers library drops them."""
    special = getattr(self.text_tokenizer, "special_ids", frozenset()) if skip_special_tokens else frozenset()
    return self.text_tokenizer.decode([t for t in tokens if t < self.text_tokenizer.vocab_size and t not in special])

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    """(summed log-probability, greedy) of each ((context, continuation), context ids, continuation ids)."""
    del disable_tqdm, kwargs
    rows = []
    for _, context_ids, continuation_ids in requests:
      whole = (list(context_ids) + list(continuation_ids))[-(self.max_length + 1):]
      rows.append((whole[:-1], whole[1:], len(continuation_ids)))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    results = [None] * len(rows)
    for start in range(0, len(order), self.batch_size):
      batch = [rows[i] for i in order[start:start + self.batch_size]]
      picked_BL, greedy_BL = self.score_rows([inputs for inputs, _, _ in batch], [targets for _, targets, _ in batch])
      for i, (inputs, _, scored), picked_L, greedy_L in zip(order[start:], batch, picked_BL, greedy_BL):
        span = slice(len(inputs) - scored, len(inputs))
        results[i] = (float(picked_L[span].sum()), bool(greedy_L[span].all()))
    return results

  def score_rows(self, inputs: list, targets: list) -> tuple[np.ndarray, np.ndarray]:
    """Each row's log-probability of each target and whether it is the greedy choice, [rows, length] each, for
    right-padded rows; the batch padded to whole rows per device."""
    length = min(self.max_length, max(SHORTEST_BATCH_LENGTH, 1 << (max(map(len, inputs)) - 1).bit_length()))
    padded = -(-len(inputs) // self.rows) * self.rows
    arrays = [np.zeros((padded, length), np.int32) for _ in range(2)]
    for row, (ids, wanted) in enumerate(zip(inputs, targets)):
      arrays[0][row, :len(ids)], arrays[1][row, :len(wanted)] = ids, wanted
    picked, greedy = jax.device_get(self._scored(
        self.params, *(jax.device_put(a, self.layout.batch_sharding) for a in arrays)))
    return np.asarray(picked)[:len(inputs)], np.asarray(greedy)[:len(inputs)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    scores = []
    for (text,) in (request.args for request in requests):
      windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1)]
      scores.append(sum(score for score, _ in self._loglikelihood_tokens([(None, *w) for w in windows])))
    return scores

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    del disable_tqdm
    answers = []
    for context, options in (request.args for request in requests):
      until = options.get("until") or []
      until = ([until] if isinstance(until, str) else list(until)) + [
          self.tok_decode([self.eot_token_id], skip_special_tokens=False)]
      most = options.get("max_gen_toks", 256)
      prompt = self.tok_encode(context)[-max(1, self.max_length - most):]
      sampled = options.get("do_sample", False) and options.get("temperature", 1.0) > 0
      ids = generate(self.layout, self.params, prompt, num_tokens=min(most, self.max_length - len(prompt)),
                     temperature=options.get("temperature", 1.0) if sampled else 0.0, seed=0)[0]
      text = self.tok_decode(ids)
      for stop in until:
        text = text.split(stop)[0]
      answers.append(text)
    return answers


def _row_axes(layout: Layout) -> tuple:
  """The mesh axes a batch's rows are split over (its sharding's first dimension)."""
  first = layout.batch_sharding.spec[0] if layout.batch_sharding.spec else None
  return () if first is None else (first,) if isinstance(first, str) else tuple(first)


def from_hf(init_from: str, mesh_sizes: dict | None = None, compute: str | None = None, max_len: int = 0):
  """(config, layout, params, tokenizer) of an `hf:DIR` checkpoint on `mesh_sizes` (default all devices over
  `data`), computing in `compute` (default configs/base.py's), over `max_len` positions (default its config.json's
  max_position_embeddings, as the harness's Hugging Face class reads it); refuses a directory without the
  tokenizer that the harness's text needs."""
  tokenizer = checkpoint_tokenizer(init_from)
  if tokenizer is None:
    raise ValueError(f"{init_from} holds no tokenizer.json, and the harness's tasks are text; save the model's "
                     "tokenizer beside it (save_pretrained) or evaluate a meshlm run with --workdir.")
  checkpoint = open_init_from(init_from)
  config = set_fields(base(), {"init_from": init_from})
  config = set_fields(config, checkpoint.model_fields(config))
  if tokenizer.vocab_size > config.model.vocab_size:  # as train.py refuses token data of a larger vocabulary
    raise ValueError(f"{init_from}'s tokenizer has {tokenizer.vocab_size} ids, more than the model's vocabulary "
                     f"of {config.model.vocab_size} (config.json's vocab_size), and the ids past "
                     f"{config.model.vocab_size - 1} would be scored as garbage; save the tokenizer the model was "
                     "trained with beside it.")
  if max_len and not FAMILIES[config.model.family].rotary and max_len != config.model.max_len:
    raise ValueError(f"--max_len={max_len}: {init_from}'s learned positions are {config.model.max_len}; leave "
                     "--max_len out.")
  config = set_fields(config, {"model.max_len": max_len or checkpoint.context or config.model.max_len,
                               **{f"mesh.{axis}": size for axis, size in (mesh_sizes or {}).items()},
                               **({"precision.compute": compute} if compute else {})})
  layout = plan(config)
  return config, layout, checkpoint.load_params(layout), tokenizer


def split_perplexity(layout: Layout, params, split, eval_step, batch_size: int) -> tuple[float, int]:
  """(perplexity, tokens scored) of `split` in consecutive windows of the model's length, each token the
  target once; batches of `batch_size` windows, the tail that fills no whole batch left out. A split with a loss
  mask (fine-tuning on completions) is scored on its masked tokens alone, as its training loss is."""
  length, rows = layout.model.max_len, math.prod(layout.mesh.shape[axis] for axis in _row_axes(layout))
  if batch_size % rows:
    raise ValueError(f"--batch_size={batch_size} windows do not divide over the {rows} devices a batch's rows "
                     "are split over; give a multiple of it.")
  windows = (len(split.tokens) - 1) // length
  batches = windows // batch_size
  if batches == 0:
    raise ValueError(f"the split holds {len(split.tokens):,} tokens, fewer than one batch of {batch_size} windows "
                     f"of {length + 1}; give a smaller --batch_size or more text.")
  sums, scored = [], 0
  for b in range(batches):
    window = lambda array, r: np.asarray(array[(b * batch_size + r) * length:(b * batch_size + r + 1) * length + 1])
    rows = np.stack([window(split.tokens, r) for r in range(batch_size)]).astype(np.int32)
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    if split.mask is not None:
      batch["weights"] = np.stack([window(split.mask, r) for r in range(batch_size)])[:, 1:].astype(np.float32)
    count = int(batch["weights"].sum()) if "weights" in batch else rows[:, 1:].size
    sums.append(eval_step({"params": params}, jax.device_put(batch, layout.batch_sharding)) * count)  # the batch's mean
    scored += count
  if not scored:
    raise ValueError("the split's loss mask scores none of the tokens these windows cover; give more text.")
  return float(np.exp(np.sum(jax.device_get(sums)) / scored)), scored
