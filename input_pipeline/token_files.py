"""The on-disk token format, shared by tools/prepare.py, the built-in corpus and the loader.

A folder holds train.bin and val.bin (flat little-endian token ids, uint16 when
the vocabulary fits, else uint32) and meta.json naming the tokenizer and counts.
Data for fine-tuning on completions also holds train.mask and val.mask, one
uint8 per token: 1 where the token is scored as a prediction (the completion
and its end-of-text), 0 where it is only context (the prompt); meta.json then
says "loss_mask": true.
Preference pairs (objective=dpo) are masked data whose documents come two by two, the prompt with the
answer preferred, then with the one passed over; train.pairs and val.pairs hold each pair's token offsets
within its split, int64 [pairs, 3] (the first answer's start, the second's, the second's end), and
meta.json says "pairs": true with train_pairs and val_pairs. Their val split is the last pairs, not tokens.
The loader adds ids_checked.json, where it can: which versions of the .bin files
it found within the vocabulary, so that each version is scanned once.
"""

import contextlib
import errno
import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

FOLDER_FILES = ("train.bin", "val.bin", "meta.json")  # in the order they are replaced
MASK_FILES = ("train.mask", "val.mask")  # fine-tuning on completions: replaced before meta.json
PAIR_FILES = ("train.pairs", "val.pairs")  # preference pairs: replaced before meta.json
META_KEYS = ("tokenizer", "vocab_size", "dtype", "train_tokens", "val_tokens")
PREPARE_COMMAND = "python tools/prepare.py --input TEXT_DIR --output {}"
IDS_CHECKED = "ids_checked.json"
SCAN_TOKENS = 2**24  # tokens per vectorised pass over a file: 32 or 64 MiB in memory at a time

def token_dtype(vocab_size: int) -> np.dtype:
  """Little-endian uint16 when every id fits, else uint32."""
  return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def check_ids(ids: np.ndarray, vocab_size: int, *, where: str, first: int = 0) -> None:
  """Refuses ids outside [0, vocab_size), naming the first one; `where` formats its offset."""
  bad = np.flatnonzero((ids < 0) | (ids >= vocab_size)) if len(ids) else []
  if len(bad):
    raise ValueError(f"token id {int(ids[bad[0]])} in {where.format(first + int(bad[0]))} is outside the "
                     f"vocabulary [0, {vocab_size}); re-tokenize with the tokenizer meta.json names.")


def scores_any(mask: np.ndarray) -> bool:
  """Whether a loss mask of some tokens scores one, read SCAN_TOKENS at a time up to the first chunk that does."""
  return not len(mask) or any(mask[first:first + SCAN_TOKENS].any() for first in range(0, len(mask), SCAN_TOKENS))


def write_token_folder(folder, token_chunks, *, tokenizer: str, vocab_size: int,
                       val_fraction: float, extra_meta: dict | None = None, masked: bool = False,
                       pairs: bool = False) -> dict:
  """Streams token chunks into train.bin / val.bin / meta.json; returns the meta.

  `masked`: each chunk is a pair (ids, which of them are scored), and the masks go to train.mask / val.mask.
  `pairs` (masked too): each chunk is two such, a preference pair's answers, their offsets kept in train.pairs /
  val.pairs, and val_fraction counts pairs.
  """
  folder = Path(folder)
  created = not folder.exists()  # a folder made here goes again if the write fails
  folder.mkdir(parents=True, exist_ok=True)
  dtype = token_dtype(vocab_size)
  # Unique temp names: concurrent writers (processes on one host, or hosts sharing a
  # file system) never share a half-written file; os.replace makes each appear whole.
  run_id = uuid.uuid4().hex
  names = (*FOLDER_FILES[:2], *(MASK_FILES if masked else ()), *(PAIR_FILES if pairs else ()), FOLDER_FILES[2])
  temps = {name: folder / f"{name}.tmp-{run_id}" for name in names}
  try:
    total, offsets = 0, []
    with open(temps["train.bin"], "wb") as out, (open(temps["train.mask"], "wb") if masked
                                                   else contextlib.nullcontext()) as mask_out:
      for chunk in token_chunks:
        if pairs:
          offsets.append((total, total + len(chunk[0][0]), total + len(chunk[0][0]) + len(chunk[1][0])))
        for piece in chunk if pairs else (chunk,):
          piece, mask = (np.asarray(part) for part in piece) if masked else (np.asarray(piece), None)
          check_ids(piece, vocab_size, where=f"the tokenizer's output at token {{}} of {folder}", first=total)
          total += len(piece)  # before the write, so that a full disk's message counts this chunk
          out.write(piece.astype(dtype).tobytes())
          if masked:
            mask_out.write(mask.astype(np.uint8).tobytes())
    if pairs:
      offsets_N3 = np.asarray(offsets, np.int64).reshape(-1, 3)
      train_pairs = len(offsets_N3) - int(round(len(offsets_N3) * val_fraction))
      train_tokens = int(offsets_N3[train_pairs, 0]) if train_pairs < len(offsets_N3) else total
      offsets_N3[:train_pairs].tofile(temps["train.pairs"])
      (offsets_N3[train_pairs:] - train_tokens).tofile(temps["val.pairs"])
      extra_meta = {**(extra_meta or {}), "pairs": True, "train_pairs": train_pairs,
                    "val_pairs": len(offsets_N3) - train_pairs}
    else:
      train_tokens = total - int(round(total * val_fraction))
    val_tokens = total - train_tokens
    for kind, itemsize in (("bin", dtype.itemsize), *((("mask", 1),) if masked else ())):
      # Copy the tail to val, then cut it off: the train tokens are written only once.
      with open(temps[f"train.{kind}"], "rb") as everything, open(temps[f"val.{kind}"], "wb") as val:
        everything.seek(train_tokens * itemsize)
        shutil.copyfileobj(everything, val)
      os.truncate(temps[f"train.{kind}"], train_tokens * itemsize)
    for split, count in (("train", train_tokens), ("val", val_tokens)) if masked else ():
      if count and not scores_any(np.memmap(temps[f"{split}.mask"], dtype=np.uint8, mode="r", shape=(count,))):
        raise ValueError(f"the {split} split of {folder} would score none of its {count:,} tokens: no assistant "
                         "turn or completion falls in it, so its loss would be 0 at every step and teach nothing; "
                         "give records whose answers are scored"
                         + (", or a --val_fraction whose tail holds some." if split == "val" else "."))
    meta = dict(tokenizer=tokenizer, vocab_size=vocab_size, dtype=dtype.name,
                train_tokens=train_tokens, val_tokens=val_tokens, **({"loss_mask": True} if masked else {}),
                **(extra_meta or {}))
    temps["meta.json"].write_text(json.dumps(meta, indent=2) + "\n")
    for name, temp in temps.items():  # meta.json last: it vouches for the other files
      os.replace(temp, folder / name)
    # masks and pairs of data prepared here before belong to no tokens now
    for name in (() if masked else MASK_FILES) + (() if pairs else PAIR_FILES):
      (folder / name).unlink(missing_ok=True)
    return meta
  except BaseException as error:
    for temp in temps.values():
      temp.unlink(missing_ok=True)
    if created and not any(folder.iterdir()):
      folder.rmdir()
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
      raise ValueError(f"the disk holding {folder} is full ({error.strerror}): the tokens need at least "
                       f"{total * dtype.itemsize / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free; "
                       "nothing was written and the folder is as it was: make room, then run the same command "
                       "again.") from None
    raise


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
  """The split's token ids as a read-only memmap, checked against meta.json: the count, and every id
  within its vocabulary."""
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
  tokens = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
  check_file_ids(path, tokens, meta["vocab_size"])
  return tokens


def open_mask(folder, split: str) -> np.ndarray | None:
  """The split's loss mask (one uint8 per token, 1 where scored) as a read-only memmap, or None where the
  folder's meta.json holds no loss_mask (every token is scored); refuses a mask that scores none of its tokens."""
  folder = Path(folder)
  meta = read_meta(folder)
  if not meta.get("loss_mask"):
    return None
  path, count = folder / f"{split}.mask", meta[f"{split}_tokens"]
  if not path.is_file() or path.stat().st_size != count:
    raise ValueError(f"{path} is missing or does not hold the {count} flags its meta.json promises; "
                     f"recreate the folder with `{PREPARE_COMMAND.format(folder)} --overwrite`.")
  mask = np.memmap(path, dtype=np.uint8, mode="r", shape=(count,)) if count else np.zeros(0, np.uint8)
  if not scores_any(mask):  # else every step's loss and gradients are 0, and the run learns nothing
    raise ValueError(f"{path} scores none of its {count:,} tokens (every flag is 0): the loss would be 0 at every "
                     "step and teach nothing; prepare the folder again from records whose answers are scored "
                     "(tools/prepare.py --completion_field or --messages_field).")
  return mask


def open_pairs(folder, split: str) -> np.ndarray | None:
  """The split's preference pairs' token offsets, int64 [pairs, 3] (see the module's docstring), checked against
  its tokens; None where the folder holds no pairs."""
  folder = Path(folder)
  meta = read_meta(folder)
  if not meta.get("pairs"):
    return None
  path, count = folder / f"{split}.pairs", meta.get(f"{split}_pairs")
  if not isinstance(count, int) or not path.is_file() or path.stat().st_size != count * 3 * 8:
    raise ValueError(f"{path} is missing or does not hold the {count} pairs its meta.json promises; recreate the "
                     f"folder with tools/prepare.py --chosen_field ... --overwrite.")
  offsets_N3 = np.fromfile(path, dtype="<i8").reshape(count, 3)
  if count and not ((offsets_N3[:, 0] <= offsets_N3[:, 1]) & (offsets_N3[:, 1] <= offsets_N3[:, 2])
                    & (offsets_N3[:, 0] >= 0) & (offsets_N3[:, 2] <= meta[f"{split}_tokens"])).all():
    raise ValueError(f"{path} holds offsets outside its {meta[f'{split}_tokens']} tokens; recreate the folder with "
                     "tools/prepare.py --chosen_field ... --overwrite.")
  return offsets_N3


def check_file_ids(path: Path, tokens: np.ndarray, vocab_size: int) -> None:
  """Refuses an id of `tokens` (path's contents) outside [0, vocab_size), before a run writes anything.

  The scan reads the whole file, so one that passes is recorded in IDS_CHECKED beside it, keyed
  by the file's size and mtime: the next run reads the record instead. A folder that cannot be
  written is scanned every time.
  """
  record_path = path.parent / IDS_CHECKED
  stat = path.stat()
  version = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "vocab_size": vocab_size}
  try:
    records = dict(json.loads(record_path.read_text()))
  except (OSError, ValueError, TypeError):  # no record yet, or a damaged one: scan
    records = {}
  if records.get(path.name) == version:
    return
  for first in range(0, len(tokens), SCAN_TOKENS):
    chunk = tokens[first:first + SCAN_TOKENS]
    if chunk.max() >= vocab_size:  # ids are unsigned: only too large is possible
      check_ids(chunk, vocab_size, where=f"{path} at token {{}}", first=first)
  records[path.name] = version
  temp = record_path.with_name(f"{IDS_CHECKED}.tmp-{uuid.uuid4().hex}")
  try:
    temp.write_text(json.dumps(records, indent=2) + "\n")
    os.replace(temp, record_path)
  except OSError:  # a read-only folder, or a full disk: not recorded, so the next run scans again
    with contextlib.suppress(OSError):  # a read-only file system refuses even to unlink a missing file
      temp.unlink(missing_ok=True)
