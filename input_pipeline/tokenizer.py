"""Tokenizers: raw UTF-8 bytes (always available), GPT-2 BPE (through tiktoken), and any
Hugging Face `tokenizer.json` (through the `tokenizers` library), named `hf:DIR`."""

import json
from pathlib import Path

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


class HfTokenizer:
  """A Hugging Face tokenizer read from DIR/tokenizer.json, named `hf:DIR` (an absolute path).

  Documents are separated by the tokenizer's end-of-sequence token: `eos_token`
  in DIR/tokenizer_config.json, else the first of END_OF_TEXT it knows.
  """

  FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # what travels with it
  END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

  def __init__(self, directory: str):
    try:
      from tokenizers import Tokenizer  # optional dependency (pyproject's `hf` extra)
    except ImportError as error:
      raise ValueError(f"tokenizer hf:{directory} needs the `tokenizers` package: "
                       "pip install -e '.[hf]'.") from error
    folder = Path(directory).expanduser().resolve()
    if not (folder / "tokenizer.json").is_file():
      raise ValueError(f"tokenizer hf:{directory} has no tokenizer.json; give a directory that holds one "
                       "(a Hugging Face model's), or use byte or gpt2.")
    self.name, self.folder = f"hf:{folder}", folder
    try:
      self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as error:  # the tokenizers library raises a bare Exception
      raise ValueError(f"tokenizer hf:{directory}: {folder / 'tokenizer.json'} does not parse ({error}); "
                       "give the tokenizer.json that Tokenizer.save or save_pretrained writes.") from None
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    self.end_of_text = self._end_of_text()
    bos = self._named_token("bos_token")  # the beginning-of-sequence token, where the tokenizer has one
    self.begin_of_text = None if bos is None else self._tokenizer.token_to_id(bos)
    self.special_ids = frozenset(i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special)

  def _named_token(self, field: str) -> str | None:
    """tokenizer_config.json's `field` (a token's text), or None."""
    config_file = self.folder / "tokenizer_config.json"
    try:
      token = json.loads(config_file.read_text()).get(field) if config_file.is_file() else None
    except (ValueError, AttributeError) as error:  # not JSON, or not an object
      raise ValueError(f"tokenizer {self.name}: {config_file} is not a JSON object ({error}); give the "
                       "tokenizer_config.json that save_pretrained writes.") from None
    return token.get("content") if isinstance(token, dict) else token

  def _end_of_text(self) -> int:
    eos = self._named_token("eos_token")
    for token in ([eos] if eos else []) + list(self.END_OF_TEXT):
      if (token_id := self._tokenizer.token_to_id(token)) is not None:
        return token_id
    raise ValueError(f"tokenizer {self.name} names no end-of-text token (eos_token in tokenizer_config.json, "
                     f"or one of {', '.join(self.END_OF_TEXT)}); documents need a separator.")

  def encode(self, text: str) -> np.ndarray:
    # No special tokens added (no BOS per call): documents are joined with end_of_text instead.
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list]:
    """encode(text) and each token's (start, stop) characters in `text`."""
    encoding = self._tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(encoding.ids, np.int32), encoding.offsets

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).ravel()]
    # Runs of known ids decode together (a BPE token may be part of a character); others show U+FFFD.
    text, run = [], []
    for i in ids + [-1]:
      if 0 <= i < self.vocab_size:
        run.append(i)
        continue
      if run:
        text.append(self._tokenizer.decode(run, skip_special_tokens=False))
        run = []
      text.append("\ufffd")
    return "".join(text[:-1])

  def content(self) -> str:
    """The tokenizer.json as the tokenizers library reads it: what decides the ids, wherever it lies."""
    return self._tokenizer.to_str()

  def same_as(self, other) -> bool:
    """Whether `other` maps text to the same ids (the same tokenizer.json, wherever it lies)."""
    return isinstance(other, HfTokenizer) and self.content() == other.content()


TOKENIZERS = {"byte": ByteTokenizer, "gpt2": Gpt2Tokenizer}
HF_SCHEME = "hf:"


def load_tokenizer(name: str):
  """Returns the tokenizer called `name`: 'byte', 'gpt2' or 'hf:DIR'."""
  if name.startswith(HF_SCHEME) and name != HF_SCHEME:
    return HfTokenizer(name[len(HF_SCHEME):])
  if name not in TOKENIZERS:
    raise ValueError(f"Unknown tokenizer {name!r}; choose one of {sorted(TOKENIZERS)} or hf:DIR "
                     "(a directory holding a Hugging Face tokenizer.json).")
  return TOKENIZERS[name]()


def checkpoint_tokenizer(init_from: str) -> HfTokenizer | None:
  """The tokenizer beside an `init_from=hf:DIR` checkpoint, or None when DIR holds no tokenizer.json."""
  if not init_from.startswith(HF_SCHEME) or not (Path(init_from[len(HF_SCHEME):]).expanduser() / "tokenizer.json").is_file():
    return None
  return HfTokenizer(init_from[len(HF_SCHEME):])


def run_tokenizer_name(init_from: str, data_tokenizer: str) -> str:
  """The name of the tokenizer a run's text goes through: its `init_from` checkpoint's when it has one,
  else its data's."""
  pretrained = checkpoint_tokenizer(init_from)
  return data_tokenizer if pretrained is None else pretrained.name


def run_tokenizer(init_from: str, data_tokenizer: str, data_origin: str):
  """The tokenizer a run's text goes through (run_tokenizer_name), loaded.

  Refuses, in one line, token data that another tokenizer wrote (synthetic data carries no text).
  """
  name = run_tokenizer_name(init_from, data_tokenizer)
  if name == data_tokenizer:
    return load_tokenizer(name)
  pretrained = load_tokenizer(name)
  if data_origin != "synthetic" and not (data_tokenizer.startswith(HF_SCHEME)
                                         and pretrained.same_as(load_tokenizer(data_tokenizer))):
    raise ValueError(f"{data_origin} holds {data_tokenizer} tokens, but init_from={init_from} has its own "
                     f"tokenizer; prepare the text with `python tools/prepare.py --tokenizer={pretrained.name} ...` "
                     "(or train on --config.data.source=synthetic).")
  return pretrained
