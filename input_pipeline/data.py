"""Batches as a pure function of (seed, step), read per process, prefetched on a thread."""

import dataclasses
import queue
import threading
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from input_pipeline.corpus import builtin_corpus
from input_pipeline.token_files import PREPARE_COMMAND, open_mask, open_pairs, open_tokens, read_meta

SOURCES = ("builtin", "tokens", "synthetic")
SPLITS = {"train": 1, "val": 2}  # mixed into every batch seed, so train and val never share one
# A preference pair's batch (objective=dpo): for each answer, its inputs, targets and mask, [B, T] int32, under
# the keys f"{answer}_{field}".
ANSWERS = ("chosen", "rejected")
PAIR_FIELDS = ("inputs", "targets", "mask")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSplit:
  """One split of a token source; `tokens` is None for synthetic data."""

  name: str  # 'train' | 'val'
  tokens: np.ndarray | None
  vocab_size: int
  tokenizer: str
  origin: str  # a folder, or 'synthetic': named in error messages
  mask: np.ndarray | None = None  # fine-tuning on completions: 1 where a token is scored (token_files.py)
  pairs: np.ndarray | None = None  # preference pairs: each one's token offsets, int64 [pairs, 3] (token_files.py)


def data_seed(config) -> int:
  """The seed of the data's order (the batches, the evaluation's, GRPO's prompts): data.seed, or where it is
  negative the run's seed, which then sets the initial weights and the data alike."""
  return config.seed if config.data.seed < 0 else config.data.seed


def open_split(data_config, split: str, *, vocab_size: int) -> TokenSplit:
  """Opens `split` of data_config's source; `vocab_size` is config.model.vocab_size."""
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; choose one of {list(SPLITS)}.")
  source = data_config.source
  if source == "synthetic":
    # Random ids carry no text; byte decoding still shows something when sampling.
    return TokenSplit(split, None, vocab_size, "byte", "synthetic")
  if source == "builtin":
    folder = builtin_corpus()
  elif source == "tokens":
    if not data_config.path:
      raise ValueError("--config.data.source=tokens needs --config.data.path=DIR, a folder "
                       f"written by `{PREPARE_COMMAND.format('DIR')}`.")
    folder = Path(data_config.path).expanduser()
  else:
    raise ValueError(f"data.source={source!r} is unknown; use one of {', '.join(SOURCES)}.")
  meta = read_meta(folder)
  if meta["vocab_size"] > vocab_size:
    raise ValueError(f"{folder} holds {meta['tokenizer']} tokens with vocab {meta['vocab_size']}, "
                     f"more than model.vocab_size={vocab_size}; set "
                     f"--config.model.vocab_size={meta['vocab_size']}.")
  return TokenSplit(split, open_tokens(folder, split), meta["vocab_size"], meta["tokenizer"],
                    str(folder), open_mask(folder, split), open_pairs(folder, split))


def check_long_enough(split: TokenSplit, seq_len: int) -> None:
  """Refuses a split too short for one window of seq_len + 1 tokens (synthetic data never is), or a split of
  preference pairs without one (its rows are padded, so any length will do)."""
  if split.pairs is not None:
    if not len(split.pairs):
      raise ValueError(f"The {split.name} split of {split.origin} holds no preference pairs; prepare it again with a "
                       "--val_fraction that leaves some" + (", or set --config.eval_every=0." if split.name == "val"
                                                           else " to training."))
    return
  if split.tokens is not None and len(split.tokens) < seq_len + 1:
    raise ValueError(f"The {split.name} split of {split.origin} holds {len(split.tokens)} tokens, "
                     f"fewer than seq_len + 1 = {seq_len + 1}; give it more text or lower "
                     "--config.model.max_len.")


def _rng(split: TokenSplit, seed: int, step: int, *more: int) -> np.random.Generator:
  # SeedSequence hashes every word, so neighbouring (seed, step) give unrelated streams.
  return np.random.default_rng([SPLITS[split.name], seed % 2**64, step, *more])


def batch_rows(split: TokenSplit, *, seed: int, step: int, batch_size: int, seq_len: int,
               rows: slice = slice(None)) -> np.ndarray:
  """Rows `rows` of global batch `step`, int32 [rows, seq_len + 1]: inputs plus the next token."""
  row_ids = range(batch_size)[rows]
  window = seq_len + 1
  windows_RW = np.empty((len(row_ids), window), np.int32)
  if split.tokens is None:
    # One stream per row, so a process draws only the rows it holds.
    for i, row in enumerate(row_ids):
      windows_RW[i] = _rng(split, seed, step, row).integers(0, split.vocab_size, window)
    return windows_RW
  check_long_enough(split, seq_len)
  return _windows(split, split.tokens, seed, step, batch_size, window, row_ids, windows_RW)


def mask_rows(split: TokenSplit, *, seed: int, step: int, batch_size: int, seq_len: int,
              rows: slice = slice(None)) -> np.ndarray:
  """batch_rows' windows of the split's loss mask (uint8, 1 where a token is scored), for the same tokens."""
  row_ids = range(batch_size)[rows]
  window = seq_len + 1
  return _windows(split, split.mask, seed, step, batch_size, window, row_ids, np.empty((len(row_ids), window), np.uint8))


def pair_rows(split: TokenSplit, *, seed: int, step: int, batch_size: int, seq_len: int,
              rows: slice = slice(None)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Rows `rows` of preference batch `step`: for each answer, (tokens, mask), int32 [rows, seq_len + 1]: the prompt
  then the answer from the pair's first token, cut after seq_len + 1 tokens or padded with 0 (mask 0)."""
  row_ids = range(batch_size)[rows]
  picks_B = _rng(split, seed, step).integers(0, len(split.pairs), size=batch_size)
  answers = {}
  for a, answer in enumerate(ANSWERS):
    tokens_RW, mask_RW = (np.zeros((len(row_ids), seq_len + 1), np.int32) for _ in range(2))
    for i, row in enumerate(row_ids):
      start, stop = split.pairs[picks_B[row], a:a + 2]
      stop = min(stop, start + seq_len + 1)
      tokens_RW[i, :stop - start], mask_RW[i, :stop - start] = split.tokens[start:stop], split.mask[start:stop]
    answers[answer] = tokens_RW, mask_RW
  return answers


def _windows(split: TokenSplit, values, seed, step, batch_size, window, row_ids, out_RW) -> np.ndarray:
  # Drawing all B starts is cheap and keeps each row's start independent of `rows`.
  starts_B = _rng(split, seed, step).integers(0, len(split.tokens) - window + 1, size=batch_size)
  for i, row in enumerate(row_ids):
    out_RW[i] = values[starts_B[row]:starts_B[row] + window]
  return out_RW


def global_batch(split: TokenSplit, *, seed: int, step: int, batch_size: int, seq_len: int,
                 sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
  """Batch `step` as {'inputs', 'targets'}: int32 [B, T] jax.Arrays laid out by `sharding`; with a loss mask
  (fine-tuning on completions) also 'weights', float32 [B, T]: 1 where the target is scored, else 0. A split of
  preference pairs gives each answer's inputs, targets and mask instead (ANSWERS, PAIR_FIELDS)."""
  windows_by_rows = {}  # devices holding the same rows (e.g. over `tensor`) share one read

  def windows(index, read=batch_rows) -> np.ndarray:
    key = (index[0].indices(batch_size), read)
    if key not in windows_by_rows:
      windows_by_rows[key] = read(split, seed=seed, step=step, batch_size=batch_size, seq_len=seq_len,
                                  rows=index[0])
    return windows_by_rows[key]

  shape = (batch_size, seq_len)
  if split.pairs is not None:  # targets and masks are the windows' positions 1..T, inputs 0..T-1
    entry = lambda answer, part, cut: jax.make_array_from_callback(
        shape, sharding, lambda index: windows(index, pair_rows)[answer][part][:, cut][:, index[1]], dtype=np.int32)
    return {f"{answer}_{field}": entry(answer, part, cut) for answer in ANSWERS
            for field, part, cut in zip(PAIR_FIELDS, (0, 0, 1), (slice(None, -1), slice(1, None), slice(1, None)))}
  batch = dict(
      inputs=jax.make_array_from_callback(
          shape, sharding, lambda index: windows(index)[:, :-1][:, index[1]], dtype=np.int32),
      targets=jax.make_array_from_callback(
          shape, sharding, lambda index: windows(index)[:, 1:][:, index[1]], dtype=np.int32))
  if split.mask is None:
    return batch
  return {**batch, "weights": jax.make_array_from_callback(
      shape, sharding, lambda index: windows(index, mask_rows)[:, 1:][:, index[1]].astype(np.float32),
      dtype=np.float32)}


class Prefetcher:
  """Yields (step, build_batch(step)) for steps [start, stop), built `depth` ahead on a thread.

  depth 0 builds each batch when asked. An exception in build_batch is re-raised by the
  consumer's next(); close() (or leaving a `with` block) stops the worker early.
  """

  def __init__(self, build_batch, *, start: int, stop: int, depth: int):
    self._build_batch, self._steps, self._depth = build_batch, iter(range(start, stop)), depth
    self._closed = threading.Event()
    if depth > 0:
      self._queue = queue.Queue(maxsize=depth)
      self._worker = threading.Thread(target=self._work, name="meshlm-prefetch", daemon=True)
      self._worker.start()

  def _work(self):
    # Queue items: (step, batch, None) per step, then None when done or (None, None, error).
    try:
      for step in self._steps:
        if not self._put((step, self._build_batch(step), None)):
          return
      self._put(None)
    except BaseException as error:  # pylint: disable=broad-except
      self._put((None, None, error))

  def _put(self, item) -> bool:
    # Time out now and then, so that close() never leaves the worker blocked on a full queue.
    while not self._closed.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        pass
    return False

  def __iter__(self):
    return self

  def __next__(self):
    if self._closed.is_set():
      raise StopIteration
    if self._depth == 0:
      step = next(self._steps)
      return step, self._build_batch(step)
    item = self._queue.get()
    if item is None or item[2] is not None:
      self.close()  # the worker has finished
      if item is None:
        raise StopIteration
      raise item[2]
    return item[:2]

  def close(self):
    """Stops the worker (after the batch it is building) and drops the batches built ahead."""
    self._closed.set()
    if self._depth > 0:
      self._worker.join()
      while not self._queue.empty():
        self._queue.get_nowait()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def batches(split: TokenSplit, *, seed: int, start: int, stop: int, shape_at: Callable[[int], tuple[int, int]],
            sharding: jax.sharding.Sharding, depth: int) -> Prefetcher:
  """A Prefetcher of global batches for steps [start, stop), step s's of shape_at(s) = (sequences, positions) (a
  curriculum grows them, training/curriculum.py)."""
  def build(step: int) -> dict:
    batch_size, seq_len = shape_at(step)
    return global_batch(split, seed=seed, step=step, batch_size=batch_size, seq_len=seq_len, sharding=sharding)

  return Prefetcher(build, start=start, stop=stop, depth=depth)
