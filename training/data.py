"""Token data: on-disk format, built-in corpus, batches as a pure function of (seed, step)."""

import dataclasses
import json
import os
import platform
import queue
import shutil
import sysconfig
import threading
import uuid
from pathlib import Path

import jax
import numpy as np
import pydoc_data.topics

SOURCES = ("builtin", "tokens", "synthetic")
SPLITS = {"train": 1, "val": 2}  # mixed into every batch seed, so train and val never share one
FOLDER_FILES = ("train.bin", "val.bin", "meta.json")  # in the order they are replaced
META_KEYS = ("tokenizer", "vocab_size", "dtype", "train_tokens", "val_tokens")
PREPARE_COMMAND = "python tools/prepare.py --input TEXT_DIR --output {}"

BUILTIN_RECIPE = "python-stdlib-sources+pydoc-topics/v1"
BUILTIN_MAX_TOKENS = 16 * 2**20
BUILTIN_VAL_FRACTION = 0.05
SKIPPED_STDLIB_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


# The on-disk format, shared with tools/prepare.py.

def token_dtype(vocab_size: int) -> np.dtype:
  """Little-endian uint16 when every id fits, else uint32."""
  return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def write_token_folder(folder, token_chunks, *, tokenizer: str, vocab_size: int,
                       val_fraction: float, extra_meta: dict | None = None) -> dict:
  """Streams token chunks into train.bin / val.bin / meta.json; returns the meta."""
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  dtype = token_dtype(vocab_size)
  # Unique temp names: concurrent writers (processes on one host, or hosts sharing a
  # file system) never share a half-written file; os.replace makes each appear whole.
  run_id = uuid.uuid4().hex
  temps = {name: folder / f"{name}.tmp-{run_id}" for name in FOLDER_FILES}
  try:
    total = 0
    with open(temps["train.bin"], "wb") as out:
      for chunk in token_chunks:
        out.write(np.asarray(chunk).astype(dtype).tobytes())
        total += len(chunk)
    val_tokens = int(round(total * val_fraction))
    train_tokens = total - val_tokens
    # Copy the tail to val.bin, then cut it off: the train tokens are written only once.
    with open(temps["train.bin"], "rb") as everything, open(temps["val.bin"], "wb") as val:
      everything.seek(train_tokens * dtype.itemsize)
      shutil.copyfileobj(everything, val)
    os.truncate(temps["train.bin"], train_tokens * dtype.itemsize)
    meta = dict(tokenizer=tokenizer, vocab_size=vocab_size, dtype=dtype.name,
                train_tokens=train_tokens, val_tokens=val_tokens, **(extra_meta or {}))
    temps["meta.json"].write_text(json.dumps(meta, indent=2) + "\n")
    for name, temp in temps.items():  # meta.json last: it vouches for the .bin files
      os.replace(temp, folder / name)
    return meta
  finally:
    for temp in temps.values():
      temp.unlink(missing_ok=True)


def read_meta(folder) -> dict:
  """The folder's meta.json, or one clear ValueError saying how to make a good one."""
  folder = Path(folder)
  command = PREPARE_COMMAND.format(folder)
  if not folder.is_dir():
    raise ValueError(f"Data folder {folder} does not exist; create it with `{command}`.")
  meta_path = folder / "meta.json"
  try:
    meta = json.loads(meta_path.read_text())
  except (OSError, ValueError):
    raise ValueError(f"{meta_path} is missing or not valid JSON; recreate the folder with "
                     f"`{command} --overwrite`.") from None
  if (not isinstance(meta, dict) or any(key not in meta for key in META_KEYS)
      or meta["dtype"] not in ("uint16", "uint32")):
    raise ValueError(f"{meta_path} does not hold {list(META_KEYS)} with dtype uint16 or "
                     f"uint32; recreate the folder with `{command} --overwrite`.")
  return meta


def open_tokens(folder, split: str) -> np.ndarray:
  """The split's token ids as a read-only memmap, checked against meta.json."""
  folder = Path(folder)
  meta = read_meta(folder)
  path, count = folder / f"{split}.bin", meta[f"{split}_tokens"]
  dtype = np.dtype(meta["dtype"]).newbyteorder("<")
  if not path.is_file() or path.stat().st_size != count * dtype.itemsize:
    raise ValueError(f"{path} is missing or does not hold the {count} tokens its meta.json "
                     f"promises; recreate the folder with `{PREPARE_COMMAND.format(folder)} "
                     "--overwrite`.")
  if count == 0:
    return np.zeros(0, dtype)  # np.memmap refuses empty files
  return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


# The built-in corpus: text every machine with Python already has.

def builtin_folder() -> Path:
  """Where the built-in corpus is cached: $MESHLM_CACHE/builtin or ~/.cache/meshlm/builtin."""
  root = os.environ.get("MESHLM_CACHE")
  return Path(root) / "builtin" if root else Path.home() / ".cache" / "meshlm" / "builtin"


def builtin_documents():
  """Yields the corpus documents as bytes, in a fixed order."""
  # Prose first, so the last 5% (val) is Python source like most of train.
  topics = pydoc_data.topics.topics
  for key in sorted(topics):
    yield topics[key].encode("utf-8")
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  relative_paths = []
  for folder, subfolders, files in os.walk(stdlib):
    subfolders[:] = [name for name in subfolders if name not in SKIPPED_STDLIB_DIRS]
    relative_paths += [Path(folder, name).relative_to(stdlib).as_posix()
                       for name in files if name.endswith(".py")]
  for relative_path in sorted(relative_paths):
    yield (stdlib / relative_path).read_bytes()


def _builtin_chunks():
  budget = BUILTIN_MAX_TOKENS
  for document in builtin_documents():
    # A file's bytes are its byte tokens; the newline is the byte tokenizer's separator.
    chunk = np.frombuffer(document + b"\n", np.uint8)[:budget]
    yield chunk
    budget -= len(chunk)
    if budget == 0:
      return


def builtin_corpus() -> Path:
  """The built-in corpus folder, tokenized and cached on first use."""
  folder = builtin_folder()
  # The stdlib differs between Python versions: a cache built by another one is rebuilt.
  recipe = f"{BUILTIN_RECIPE}, Python {platform.python_version()}"
  try:
    if read_meta(folder).get("recipe") == recipe:
      return folder
  except ValueError:
    pass  # missing or damaged: build it
  write_token_folder(folder, _builtin_chunks(), tokenizer="byte", vocab_size=256,
                     val_fraction=BUILTIN_VAL_FRACTION, extra_meta={"recipe": recipe})
  return folder


# Splits and batches.

@dataclasses.dataclass(frozen=True, eq=False)
class TokenSplit:
  """One split of a token source; `tokens` is None for synthetic data."""

  name: str  # 'train' | 'val'
  tokens: np.ndarray | None
  vocab_size: int
  tokenizer: str
  origin: str  # a folder, or 'synthetic': named in error messages


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
    raise ValueError(f"Unknown data source {source!r}; choose one of {list(SOURCES)}.")
  meta = read_meta(folder)
  if meta["vocab_size"] > vocab_size:
    raise ValueError(f"{folder} holds {meta['tokenizer']} tokens with vocab {meta['vocab_size']}, "
                     f"more than model.vocab_size={vocab_size}; set "
                     f"--config.model.vocab_size={meta['vocab_size']}.")
  return TokenSplit(split, open_tokens(folder, split), meta["vocab_size"], meta["tokenizer"],
                    str(folder))


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
  if len(split.tokens) < window:
    raise ValueError(f"The {split.name} split of {split.origin} holds {len(split.tokens)} tokens, "
                     f"fewer than seq_len + 1 = {window}; give it more text or lower "
                     "--config.model.max_len.")
  # Drawing all B starts is cheap and keeps each row's start independent of `rows`.
  starts_B = _rng(split, seed, step).integers(0, len(split.tokens) - window + 1, size=batch_size)
  for i, row in enumerate(row_ids):
    windows_RW[i] = split.tokens[starts_B[row]:starts_B[row] + window]
  return windows_RW


def global_batch(split: TokenSplit, *, seed: int, step: int, batch_size: int, seq_len: int,
                 sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
  """Batch `step` as {'inputs', 'targets'}: int32 [B, T] jax.Arrays laid out by `sharding`."""
  windows_by_rows = {}  # devices holding the same rows (e.g. over `tensor`) share one read

  def windows(index) -> np.ndarray:
    key = index[0].indices(batch_size)
    if key not in windows_by_rows:
      windows_by_rows[key] = batch_rows(split, seed=seed, step=step, batch_size=batch_size,
                                        seq_len=seq_len, rows=index[0])
    return windows_by_rows[key]

  shape = (batch_size, seq_len)
  return dict(
      inputs=jax.make_array_from_callback(
          shape, sharding, lambda index: windows(index)[:, :-1][:, index[1]], dtype=np.int32),
      targets=jax.make_array_from_callback(
          shape, sharding, lambda index: windows(index)[:, 1:][:, index[1]], dtype=np.int32))


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


def batches(split: TokenSplit, *, seed: int, start: int, stop: int, batch_size: int,
            seq_len: int, sharding: jax.sharding.Sharding, depth: int) -> Prefetcher:
  """A Prefetcher of global batches for steps [start, stop)."""
  return Prefetcher(lambda step: global_batch(split, seed=seed, step=step, batch_size=batch_size,
                                              seq_len=seq_len, sharding=sharding),
                    start=start, stop=stop, depth=depth)
