"""GRPO's rollouts: each step's prompts, the policy's completions of them sampled on the run's mesh with the KV
cache (training/sample.py), their rewards and advantages (training/grpo.py), laid out as the step's batch.

A step's prompts and its sampling key are functions of (seed, step), and its completions of those and the weights
the step starts from: a resumed run samples what the uninterrupted one did.
"""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from input_pipeline.data import data_seed
from training import grpo, rewards
from training.sample import check_request, decode_batch, make_sampler


@dataclasses.dataclass(frozen=True)
class Prompts:
  """Tokenized prompts and the answers their rewards check."""
  ids: list
  answers: list


def read_prompts(path: str, prompt_field: str, answer_field: str, tokenizer, setting: str) -> Prompts:
  """The records of the JSON-lines file `path` (named by config `setting`), each prompt tokenized."""
  if not Path(path).is_file():
    raise ValueError(f"{setting}={path!r} is not a file; give a JSON-lines file of records with "
                     f"{prompt_field!r} and {answer_field!r}.")
  ids, answers = [], []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      record = json.loads(line)
      missing = [field for field in (prompt_field, answer_field) if field not in record]
      if missing:
        raise ValueError(f"record {number} of {path} has no {missing[0]!r} (it has {sorted(record)}); set "
                         "grpo.prompt_field and grpo.answer_field to the fields that hold them.")
      ids.append(np.asarray(tokenizer.encode(record[prompt_field]), np.int32))
      answers.append(str(record[answer_field]))
  if not ids:
    raise ValueError(f"{setting}={path!r} holds no records.")
  return Prompts(ids, answers)


def stop_tokens(tokenizer, stop: str) -> np.ndarray:
  """The ids that end a completion: end-of-text and each text of the comma list `stop`, one token each."""
  ids = [tokenizer.end_of_text]
  for text in filter(None, stop.split(",")):
    encoded = tokenizer.encode(text)
    if len(encoded) != 1:
      raise ValueError(f"grpo.stop holds {text!r}, which is {len(encoded)} tokens to this tokenizer; give texts "
                       "of one token each.")
    ids.append(int(encoded[0]))
  return np.asarray(ids, np.int32)


def completion_lengths(tokens_BN: np.ndarray, stop_ids: np.ndarray) -> np.ndarray:
  """Each completion's length: through its first stop token, else all of it."""
  stops_BN = np.isin(tokens_BN, stop_ids)
  return np.where(stops_BN.any(1), stops_BN.argmax(1) + 1, tokens_BN.shape[1])


def batch_entries(prompts: list, completions: list, lengths_B, advantages_B, length: int, settings) -> dict:
  """[B, `length`] entries of grpo.FIELDS: each row its prompt and the first `lengths_B` tokens of its completion,
  those tokens weighted as the loss type averages them (grpo.completion_weights), the row's advantage throughout."""
  b = len(prompts)
  sequence_BS = np.zeros((b, length + 1), np.int32)
  mask_BT = np.zeros((b, length), np.float32)
  for row, (prompt, tokens_N, n) in enumerate(zip(prompts, completions, lengths_B)):
    p = len(prompt)
    sequence_BS[row, :p + n] = np.concatenate([prompt, tokens_N[:n]])
    mask_BT[row, p - 1:p - 1 + n] = 1  # the targets that are the completion's tokens
  return {"inputs": sequence_BS[:, :-1], "targets": sequence_BS[:, 1:],
          "completion_weights": grpo.completion_weights(mask_BT, settings.loss, settings.max_new_tokens),
          "advantages": np.broadcast_to(advantages_B[:, None], (b, length)).astype(np.float32)}


class Rollouts:
  """Samples, scores and lays out GRPO's batches for `layout`, and scores greedy answers to held-out prompts."""

  def __init__(self, config, layout, tokenizer):
    g = config.grpo
    self._layout, self._tokenizer, self._seed = layout, tokenizer, data_seed(config)
    self._settings = grpo.settings(config)
    self._sampling = (np.float32(g.temperature), np.int32(g.top_k), np.float32(g.top_p))
    self._batch_size, self._length = config.batch_size, layout.model.max_len
    self.prompts = read_prompts(g.prompts, g.prompt_field, g.answer_field, tokenizer, "grpo.prompts")
    self.eval_prompts = (read_prompts(g.eval_prompts, g.prompt_field, g.answer_field, tokenizer, "grpo.eval_prompts")
                         if g.eval_prompts else None)
    for prompts in filter(None, (self.prompts, self.eval_prompts)):
      longest = max(len(ids) for ids in prompts.ids)
      check_request(self._length, longest, g.max_new_tokens, g.temperature, g.top_k, layout.model.vocab_size, g.top_p)
    self._stop_ids = stop_tokens(tokenizer, g.stop)
    self._reward = rewards.reward(g.reward)
    self._rows = decode_batch(layout, config.batch_size)  # the most rows one call samples
    self._samplers = {}  # by (prompt length, rows): each compiles once

  def _sampler(self, length: int, count: int):
    """The sampler for `count` prompts of `length` tokens: rows for the next power of two of them (at most
    _rows), so that a step's few prompts of one length do not pay for a whole batch, and few sizes compile."""
    rows = min(self._rows, decode_batch(self._layout, 1 << (count - 1).bit_length()))
    if (length, rows) not in self._samplers:
      self._samplers[length, rows] = make_sampler(self._layout, batch=rows, prompt_len=length,
                                                  num_tokens=self._settings.max_new_tokens)
    return self._samplers[length, rows], rows

  def _complete(self, weights, prompts: list, key, sampling) -> list:
    """One completion [max_new_tokens] of each prompt in `prompts`, those of a length sampled together."""
    completions = [None] * len(prompts)
    by_length = {}
    for i, ids in enumerate(prompts):
      by_length.setdefault(len(ids), []).append(i)
    for length, indices in sorted(by_length.items()):
      for start in range(0, len(indices), self._rows):
        chunk = indices[start:start + self._rows]
        sampler, rows = self._sampler(length, len(chunk))
        prompt_BP = np.stack([prompts[i] for i in chunk] + [prompts[chunk[0]]] * (rows - len(chunk)))
        tokens_BN, _ = sampler(weights, prompt_BP, jax.random.fold_in(jax.random.fold_in(key, length), start),
                               *sampling)
        for i, tokens_N in zip(chunk, jax.device_get(tokens_BN)):
          completions[i] = tokens_N
    return completions

  def _texts(self, completions: list) -> tuple[list, np.ndarray]:
    tokens_BN = np.stack(completions)
    lengths_B = completion_lengths(tokens_BN, self._stop_ids)
    # The stop token ends the text, it is not part of it.
    texts = [self._tokenizer.decode(tokens_N[:n - np.isin(tokens_N[n - 1], self._stop_ids)])
             for tokens_N, n in zip(tokens_BN, lengths_B)]
    return texts, lengths_B

  def batch(self, weights, step: int) -> tuple[dict, dict]:
    """Step `step`'s batch, sampled from `weights` (the model's, as the step starts), and its figures: the
    rewards' mean and deviation, the completions' mean length, the share of groups whose rewards are equal."""
    group = self._settings.group
    rng = np.random.default_rng([self._seed, step])
    count = len(self.prompts.ids)
    chosen = rng.choice(count, self._batch_size // group, replace=count < self._batch_size // group)
    rows = [i for i in chosen for _ in range(group)]  # prompt g's completions at rows g x group ...
    prompts = [self.prompts.ids[i] for i in rows]
    key = jax.random.fold_in(jax.random.key(self._seed), step)
    completions = self._complete(weights, prompts, key, self._sampling)
    texts, lengths_B = self._texts(completions)
    rewards_B = np.asarray(self._reward(texts, [self.prompts.answers[i] for i in rows]), np.float32)
    advantages_B = grpo.advantages(rewards_B, group, self._settings.scale_rewards)
    entries = batch_entries(prompts, completions, lengths_B, advantages_B, self._length, self._settings)
    sharding = self._layout.batch_sharding
    batch = {name: jax.make_array_from_callback(entry.shape, sharding, lambda index, entry=entry: entry[index])
             for name, entry in entries.items()}
    rewards_PG = rewards_B.reshape(-1, group)
    figures = {"grpo_reward": float(rewards_B.mean()), "grpo_reward_std": float(rewards_B.std()),
               "grpo_completion_length": float(lengths_B.mean()),
               "grpo_equal_groups": float((rewards_PG == rewards_PG[:, :1]).all(1).mean())}
    return batch, figures

  def evaluate(self, weights) -> float:
    """The mean reward of greedy completions of the held-out prompts."""
    prompts = self.eval_prompts
    greedy = (np.float32(0), np.int32(0), np.float32(1))
    texts, _ = self._texts(self._complete(weights, prompts.ids, jax.random.key(self._seed), greedy))
    return float(np.mean(self._reward(texts, prompts.answers)))
