"""Tokenizers: raw UTF-8 bytes (always available) and GPT-2 BPE (through tiktoken)."""

import numpy as np

# An invalid UTF-8 byte: ids a tokenizer cannot map (e.g. from a vocabulary padded
# past its size) become it, so decoding shows U+FFFD instead of failing.
_INVALID_UTF8 = b"\xff"


class ByteTokenizer:
  """One token per UTF-8 byte: vocab 256, no files, works offline."""

  name = "byte"
  vocab_size = 256
  end_of_text = ord("\n")  # documents are separated by a newline, as in a text file

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids, np.int64).ravel()
    raw = np.where((ids >= 0) & (ids < 256), ids, _INVALID_UTF8[0]).astype(np.uint8)
    return raw.tobytes().decode("utf-8", errors="replace")


class Gpt2Tokenizer:
  """GPT-2's 50,257-token BPE, with <|endoftext|> between documents."""

  name = "gpt2"

  def __init__(self):
    try:
      import tiktoken  # optional dependency (pyproject's `bpe` extra)
      self._encoding = tiktoken.get_encoding("gpt2")
    except Exception as error:  # no tiktoken, no network, or a corrupt cached file
      raise ValueError(
          "The gpt2 encoding could not be loaded (tiktoken needs to download it "
          f"or find it in TIKTOKEN_CACHE_DIR: {type(error).__name__}); "
          "`--tokenizer=byte` works offline.") from error
    self.vocab_size = self._encoding.n_vocab
    self.end_of_text = self._encoding.eot_token

  def encode(self, text: str) -> np.ndarray:
    # encode_ordinary: a literal "<|endoftext|>" in a corpus is text, not a separator.
    return np.asarray(self._encoding.encode_ordinary(text), np.int32)

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).ravel()]
    if all(0 <= i < self.vocab_size for i in ids):
      return self._encoding.decode(ids, errors="replace")
    pieces = [self._encoding.decode_single_token_bytes(i) if 0 <= i < self.vocab_size
              else _INVALID_UTF8 for i in ids]
    return b"".join(pieces).decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer, "gpt2": Gpt2Tokenizer}


def load_tokenizer(name: str):
  """Returns the tokenizer called `name` ('byte' or 'gpt2')."""
  if name not in TOKENIZERS:
    raise ValueError(f"Unknown tokenizer {name!r}; choose one of {sorted(TOKENIZERS)}.")
  return TOKENIZERS[name]()
