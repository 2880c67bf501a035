"""A folder of text, or one field of a dataset's records, tokenized into a token folder (input_pipeline/token_files.py):
the documents read, checked and encoded in order by worker processes. tools/prepare.py is its command line,
and its docstring says what each choice does; a refusal names the flag that would fix it.
"""

import itertools
import multiprocessing
from pathlib import Path

import numpy as np
from tqdm import tqdm

from input_pipeline import chat_template, token_files, tokenizer
from input_pipeline.dataset_texts import (FORMATS, PreferencePair, dataset_completions, dataset_conversations,
                                          dataset_pairs, dataset_texts)

# Plain-text formats; anything else (images, archives, .bin) is skipped rather than sniffed,
# so what goes into a dataset never depends on a guess about a file's contents.
TEXT_SUFFIXES = frozenset((
    ".txt", ".md", ".rst", ".tex", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go",
    ".java", ".js", ".ts", ".sh", ".html", ".xml", ".css", ".csv", ".tsv", ".yaml", ".yml", ".toml"))
BATCH = 64  # documents per task handed to a tokenizing worker

def text_files(folder: Path, *, skip: Path | None = None) -> list[Path]:
  """The text files under `folder`, sorted, outside hidden folders and `skip`."""
  found = []
  for path in folder.rglob("*"):
    relative_parts = path.relative_to(folder).parts
    if (path.suffix.lower() in TEXT_SUFFIXES and path.is_file()
        and not any(part.startswith(".") for part in relative_parts)
        and not (skip and path.resolve().is_relative_to(skip.resolve()))):
      found.append(path)
  return sorted(found, key=lambda path: path.relative_to(folder).as_posix())


def prepare(input_dir, output_dir, *, tokenizer_name: str = "byte", val_fraction: float = 0.05,
            overwrite: bool = False, dataset: str | None = None, text_field: str = "text",
            completion_field: str | None = None, messages_field: str | None = None, chosen_field: str | None = None,
            rejected_field: str | None = None, workers: int = 1, progress: bool = False) -> tuple[int, dict]:
  """Tokenizes `input_dir` (or `dataset`'s `text_field`, followed by its `completion_field` where given, or its
  `messages_field` conversations, or its `chosen_field` and `rejected_field` answers to it as preference pairs)
  into `output_dir`; returns (documents, meta)."""
  output_dir = Path(output_dir).expanduser()
  if (input_dir is None) == (dataset is None):
    raise ValueError("give one of --input (a folder of text files) and --dataset (records with a text field).")
  if not 0 <= val_fraction < 1:
    raise ValueError(f"--val_fraction={val_fraction} must be in [0, 1).")
  if workers < 1:
    raise ValueError(f"--workers={workers} must be at least 1.")
  if completion_field and dataset is None:
    raise ValueError(f"--completion_field={completion_field} reads records: give them as --dataset (jsonl, "
                     "parquet, ...) with --text_field naming the prompt.")
  if messages_field and (dataset is None or completion_field):
    raise ValueError(f"--messages_field={messages_field} reads conversations from records: give them as --dataset, "
                     "without --completion_field (a record is a conversation or a prompt and completion).")
  if bool(chosen_field) != bool(rejected_field):
    raise ValueError("preference pairs need both --chosen_field and --rejected_field (the answer preferred and the "
                     "one passed over), with --text_field naming the prompt.")
  if chosen_field and (dataset is None or completion_field or messages_field):
    raise ValueError(f"--chosen_field={chosen_field} reads preference pairs from records: give them as --dataset, "
                     "without --completion_field or --messages_field.")
  if output_dir.exists() and not output_dir.is_dir():
    raise ValueError(f"--output={output_dir} is a file, not a folder; give a folder for train.bin, "
                     "val.bin and meta.json.")
  existing = [name for name in token_files.FOLDER_FILES if (output_dir / name).exists()]
  if existing and not overwrite:
    raise ValueError(f"{output_dir} already holds a prepared dataset ({', '.join(existing)}); "
                     "pass --overwrite to replace it.")
  tok = tokenizer.load_tokenizer(tokenizer_name)  # refuses a bad name before anything is read
  chat = bool(messages_field)  # records rendered with the tokenizer's chat template
  if messages_field:
    if not isinstance(tok, tokenizer.HfTokenizer):
      raise ValueError(f"--messages_field renders the tokenizer's chat template, which --tokenizer={tokenizer_name} "
                       "lacks; give the chat model's as --tokenizer=hf:DIR.")
    chat_template.ChatTemplate(tok.folder)  # refuses a tokenizer without a template before reading
    texts = dataset_conversations(dataset, messages_field)
  elif chosen_field:
    texts = dataset_pairs(dataset, text_field, chosen_field, rejected_field)
    first = next(texts)
    chat = isinstance(first.prompt, list)  # conversations
    if chat:
      if not isinstance(tok, tokenizer.HfTokenizer):
        raise ValueError(f"conversations in --chosen_field are rendered with the tokenizer's chat template, which "
                         f"--tokenizer={tokenizer_name} lacks; give the chat model's as --tokenizer=hf:DIR.")
      chat_template.ChatTemplate(tok.folder)
    texts = itertools.chain([first], texts)
  elif completion_field:
    texts = dataset_completions(dataset, text_field, completion_field)
  elif dataset is not None:
    texts = dataset_texts(dataset, text_field)
  else:
    texts = folder_texts(input_dir, output_dir)
  masked, pairs = bool(completion_field or messages_field or chosen_field), bool(chosen_field)
  with tqdm(unit=" tokens", unit_scale=True, disable=not progress) as bar:
    documents = 0

    def counted():  # the documents' ids as they stream by, counted, none kept
      nonlocal documents
      for chunk in encoded(texts, tokenizer_name, workers, chat=chat):
        bar.update(sum(len(ids) for ids, _ in chunk) if pairs else len(chunk[0] if masked else chunk))
        documents += 1
        yield chunk

    meta = token_files.write_token_folder(output_dir, counted(), tokenizer=tok.name, vocab_size=tok.vocab_size,
                                          val_fraction=val_fraction, masked=masked, pairs=pairs)
  return documents, meta


def folder_texts(input_dir, output_dir: Path):
  """The text files under `input_dir` as strings; refuses a folder without any before reading one."""
  input_dir = Path(input_dir).expanduser()
  if input_dir.is_file():
    raise ValueError(f"--input={input_dir} is a file; --input takes a folder of text files (each one a "
                     f"document), --dataset a file or folder of records ({' '.join(FORMATS)}) with "
                     "--text_field naming the field that holds the text.")
  if not input_dir.is_dir():
    raise ValueError(f"Input folder {input_dir} does not exist.")
  # A dataset inside its own input folder must not be read back in on the next run.
  files = text_files(input_dir, skip=output_dir)
  if not files:
    raise ValueError(f"{input_dir} holds no text files ({' '.join(sorted(TEXT_SUFFIXES))}); "
                     "for json, jsonl or parquet records use --dataset with --text_field.")
  # Decoding bytes (not read_text) keeps "\r\n" as written: the text round-trips exactly.
  return (path.read_bytes().decode("utf-8", errors="replace") for path in files)


def encoded(texts, tokenizer_name: str, workers: int, chat: bool = False):
  """Each text's ids followed by the end-of-text, in order; `workers` processes encode batches of BATCH.

  A (prompt, completion) pair instead gives (ids, mask): the prompt's ids then the completion's and the
  end-of-text, the mask 1 on the latter only (each part tokenized on its own, so the prompt ends where
  its text does). A PreferencePair gives two such, the prompt with each answer. A conversation (a list of messages, with `chat`) gives (ids, mask) too: the ids of its
  chat template's rendering, whole, the mask 1 on the tokens of the assistant's turns."""
  batches = iter(lambda: list(itertools.islice(texts, BATCH)), [])
  if workers == 1:
    _load_worker_tokenizer(tokenizer_name, chat)
    yield from itertools.chain.from_iterable(map(_encode_batch, batches))
    return
  # Spawned, not forked: a fork would copy the parent's threads (tokenizers', tqdm's) mid-flight.
  with multiprocessing.get_context("spawn").Pool(workers, _load_worker_tokenizer, (tokenizer_name, chat)) as pool:
    yield from itertools.chain.from_iterable(pool.imap(_encode_batch, batches))


_worker_tokenizer, _worker_chat = None, None


def _load_worker_tokenizer(name: str, chat: bool):
  global _worker_tokenizer, _worker_chat
  _worker_tokenizer = tokenizer.load_tokenizer(name)
  _worker_chat = chat_template.ChatTemplate(_worker_tokenizer.folder) if chat else None


def _encode_batch(texts: list) -> list:
  encode = {tuple: lambda pair: _encode_pair(*pair), list: _encode_conversation, str: _encode_document,
            PreferencePair: _encode_preference}
  return [encode[type(text)](text) for text in texts]


def _encode_document(text: str) -> np.ndarray:
  return np.append(_worker_tokenizer.encode(text), np.int32(_worker_tokenizer.end_of_text)).astype(np.int32)


def _encode_pair(prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
  prompt_ids, completion_ids = np.asarray(_worker_tokenizer.encode(prompt)), _encode_document(completion)
  mask = np.concatenate([np.zeros(len(prompt_ids), np.uint8), np.ones(len(completion_ids), np.uint8)])
  return np.concatenate([prompt_ids, completion_ids]).astype(np.int32), mask


def _encode_conversation(messages: list, scored_turns: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(ids, mask) of a conversation: its assistant turns scored, or only the last `scored_turns` of them."""
  try:
    text, spans = _worker_chat.assistant_spans(messages)
  except ValueError as error:
    raise ValueError(f"the conversation that begins {messages[0]['content'][:40]!r}: {error}") from None
  ids, offsets = _worker_tokenizer.encode_with_offsets(text)
  ends_on_answer = np.uint8(messages[-1]["role"] == "assistant")
  kept = spans if scored_turns is None else spans[len(spans) - scored_turns:]
  return (np.append(ids, np.int32(_worker_tokenizer.end_of_text)).astype(np.int32),
          np.append(chat_template.scored_tokens(offsets, kept), ends_on_answer))


def _encode_preference(pair: PreferencePair) -> tuple:
  """The prompt with each answer: texts as a prompt and completion are; conversations rendered whole, only the
  answer's assistant turns scored (not those of the prompt's earlier exchanges)."""
  if not isinstance(pair.prompt, list):
    return _encode_pair(pair.prompt, pair.chosen), _encode_pair(pair.prompt, pair.rejected)
  answer_turns = lambda answer: sum(message["role"] == "assistant" for message in answer)
  return tuple(_encode_conversation(pair.prompt + answer, answer_turns(answer)) for answer in (pair.chosen, pair.rejected))
