"""Tokenizes a folder of text, or one field of a dataset, into the token folder `--config.data.source=tokens` reads.

  python tools/prepare.py --input ~/corpus --output data/corpus --tokenizer byte
  python tools/prepare.py --input ~/corpus --output data/corpus --tokenizer hf:checkpoints/llama   # its tokenizer.json
  python tools/prepare.py --dataset data/raw/shards --text_field text --output data/corpus --workers 8
  python tools/prepare.py --dataset instructions.jsonl --text_field prompt --completion_field completion --output data/sft
  python tools/prepare.py --dataset chats.jsonl --messages_field messages --tokenizer hf:checkpoints/qwen --output data/sft

--input: every file under the folder whose suffix is in TEXT_SUFFIXES (recursively, sorted by
path; hidden files and folders skipped) as UTF-8, undecodable bytes replaced by U+FFFD; each
file is one document. --dataset: each record's --text_field is one document, read through
Hugging Face `datasets` (input_pipeline/dataset_texts.py: local parquet, jsonl, arrow, csv or text
files, or a hub name when online; local json and jsonl by Python's json, record by record), so JSON and
parquet are never tokenized as raw text. Every record is checked: one without the field, or with something
other than text in it, is refused by its number.
Documents are followed by the tokenizer's end-of-text: a newline for `byte`, <|endoftext|>
for `gpt2`, the tokenizer's eos_token for `hf:DIR`. --workers processes tokenize in
parallel, in order, with a progress bar of tokens and tokens/s. The last --val_fraction of
the tokens is the val split. Writes train.bin, val.bin and meta.json (format:
input_pipeline/token_files.py), each whole or not at all.

--completion_field (with --dataset) prepares instruction data for fine-tuning on completions: each
record is its --text_field (the prompt) followed by its --completion_field and the end-of-text (a record
where either is null is refused), and train.mask / val.mask mark the completion's tokens and the end-of-text
as the only ones scored.
--messages_field (with --dataset and an hf:DIR tokenizer) does the same for conversations: each record's
field is a list of {"role", "content"} messages, rendered with the tokenizer's own chat template
(input_pipeline/chat_template.py), and the assistant's turns are the tokens scored (with the end-of-text
when the conversation ends on one). A split in which no token is scored (its loss would be 0 at every step)
is refused.
"""

import gc
import itertools
import multiprocessing
import sys
from pathlib import Path

# `python tools/prepare.py` puts tools/ on sys.path, not the repo root that holds training/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # pylint: disable=wrong-import-position
from absl import app, flags, logging  # pylint: disable=wrong-import-position
from tqdm import tqdm  # pylint: disable=wrong-import-position

from input_pipeline import chat_template, token_files, tokenizer  # pylint: disable=wrong-import-position
from input_pipeline.dataset_texts import (FORMATS, dataset_completions,  # pylint: disable=wrong-import-position
                                          dataset_conversations, dataset_texts)

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
            completion_field: str | None = None, messages_field: str | None = None, workers: int = 1,
            progress: bool = False) -> tuple[int, dict]:
  """Tokenizes `input_dir` (or `dataset`'s `text_field`, followed by its `completion_field` where given, or its
  `messages_field` conversations) into `output_dir`; returns (documents, meta)."""
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
  if output_dir.exists() and not output_dir.is_dir():
    raise ValueError(f"--output={output_dir} is a file, not a folder; give a folder for train.bin, "
                     "val.bin and meta.json.")
  existing = [name for name in token_files.FOLDER_FILES if (output_dir / name).exists()]
  if existing and not overwrite:
    raise ValueError(f"{output_dir} already holds a prepared dataset ({', '.join(existing)}); "
                     "pass --overwrite to replace it.")
  tok = tokenizer.load_tokenizer(tokenizer_name)  # refuses a bad name before anything is read
  if messages_field:
    if not isinstance(tok, tokenizer.HfTokenizer):
      raise ValueError(f"--messages_field renders the tokenizer's chat template, which --tokenizer={tokenizer_name} "
                       "lacks; give the chat model's as --tokenizer=hf:DIR.")
    chat_template.ChatTemplate(tok.folder)  # refuses a tokenizer without a template before reading
    texts = dataset_conversations(dataset, messages_field)
  elif completion_field:
    texts = dataset_completions(dataset, text_field, completion_field)
  elif dataset is not None:
    texts = dataset_texts(dataset, text_field)
  else:
    texts = folder_texts(input_dir, output_dir)
  masked = bool(completion_field or messages_field)
  with tqdm(unit=" tokens", unit_scale=True, disable=not progress) as bar:
    documents = 0

    def counted():  # the documents' ids as they stream by, counted, none kept
      nonlocal documents
      for chunk in encoded(texts, tokenizer_name, workers, chat=bool(messages_field)):
        bar.update(len(chunk[0] if masked else chunk))
        documents += 1
        yield chunk

    meta = token_files.write_token_folder(output_dir, counted(), tokenizer=tok.name, vocab_size=tok.vocab_size,
                                          val_fraction=val_fraction, masked=masked)
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
  its text does). A conversation (a list of messages, with `chat`) gives (ids, mask) too: the ids of its
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
  encode = {tuple: lambda pair: _encode_pair(*pair), list: _encode_conversation, str: _encode_document}
  return [encode[type(text)](text) for text in texts]


def _encode_document(text: str) -> np.ndarray:
  return np.append(_worker_tokenizer.encode(text), np.int32(_worker_tokenizer.end_of_text)).astype(np.int32)


def _encode_pair(prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
  prompt_ids, completion_ids = np.asarray(_worker_tokenizer.encode(prompt)), _encode_document(completion)
  mask = np.concatenate([np.zeros(len(prompt_ids), np.uint8), np.ones(len(completion_ids), np.uint8)])
  return np.concatenate([prompt_ids, completion_ids]).astype(np.int32), mask


def _encode_conversation(messages: list) -> tuple[np.ndarray, np.ndarray]:
  try:
    text, spans = _worker_chat.assistant_spans(messages)
  except ValueError as error:
    raise ValueError(f"the conversation that begins {messages[0]['content'][:40]!r}: {error}") from None
  ids, offsets = _worker_tokenizer.encode_with_offsets(text)
  ends_on_answer = np.uint8(messages[-1]["role"] == "assistant")
  return (np.append(ids, np.int32(_worker_tokenizer.end_of_text)).astype(np.int32),
          np.append(chat_template.scored_tokens(offsets, spans), ends_on_answer))


def define_flags():
  """Defines the command line; only when run, so importing prepare() leaves global flags alone."""
  flags.DEFINE_string("input", None, "Folder of text files, read recursively (or give --dataset).")
  flags.DEFINE_string("dataset", None, "Local parquet/jsonl/arrow/csv/text file or folder, or a hub dataset name.")
  flags.DEFINE_string("text_field", "text", "With --dataset: the field holding each document's text (with "
                      "--completion_field, the prompt's).")
  flags.DEFINE_string("completion_field", None, "With --dataset: the field holding each record's completion, "
                      "the only tokens the loss scores (fine-tuning on completions).")
  flags.DEFINE_string("messages_field", None, "With --dataset: the field holding each record's conversation "
                      "(a list of role/content messages), rendered with the --tokenizer=hf:DIR chat template; "
                      "the assistant's turns are the only tokens the loss scores.")
  flags.DEFINE_integer("workers", 1, "Tokenizing processes.")
  flags.DEFINE_string("output", None, "Folder to write train.bin, val.bin, meta.json.",
                      required=True)
  flags.DEFINE_string("tokenizer", "byte", "byte (works offline), gpt2 (needs tiktoken's encoding file) or "
                      "hf:DIR (DIR/tokenizer.json, e.g. an imported Hugging Face model's directory).")
  flags.DEFINE_float("val_fraction", 0.05, "Share of tokens, taken from the end, for val.")
  flags.DEFINE_bool("overwrite", False, "Replace a dataset already in --output.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  args = flags.FLAGS
  logging.set_verbosity(logging.WARNING)  # `datasets` announces jax through absl's log
  try:
    num_files, meta = prepare(args.input, args.output, tokenizer_name=args.tokenizer,
                              val_fraction=args.val_fraction, overwrite=args.overwrite, dataset=args.dataset,
                              text_field=args.text_field, completion_field=args.completion_field,
                              messages_field=args.messages_field,
                              workers=args.workers, progress=True)
  except ValueError as error:
    # A refusal can leave a dataset reader mid-file: collected now, its arrow threads stop while the
    # interpreter still runs, instead of aborting it on the way out.
    gc.collect()
    sys.exit(f"prepare.py: {error}")  # one line on stderr, exit status 1
  total = meta["train_tokens"] + meta["val_tokens"]
  print(f"Prepared {args.output} from {num_files} document{'s' * (num_files != 1)}: "
        f"{total:,} {meta['tokenizer']} tokens, {meta['train_tokens']:,} train / "
        f"{meta['val_tokens']:,} val.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
