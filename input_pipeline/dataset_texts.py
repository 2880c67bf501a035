"""Documents from one field of a dataset, read through Hugging Face `datasets` (the `data` extra).

A local file or folder of parquet, jsonl/json, arrow, csv or text files (one
format per dataset; a text file's rows are its lines), or, on a machine that
reaches the hub, a dataset's name. Everything is streamed, so a corpus larger
than memory works; JSON and parquet are read as records, never as raw text.
Local json and jsonl files are read here with Python's json module, each record
exactly as written (see _json_records for what `datasets` would change).
Files are read one at a time, so that a refusal names the file and the record:
one without the field, one whose field is not text, one that is not UTF-8, a
file unlike its format.
"""

import functools
import itertools
import json
from pathlib import Path
from typing import Iterator, NamedTuple

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv",
           ".txt": "text"}
DECODED_AS_READ = ("text", "csv")  # the builders that decode a file as they read it
LOCATE_BATCH = 1000  # records per table while looking for the one that is not UTF-8


def dataset_texts(dataset: str, text_field: str, split: str = "train") -> Iterator[str]:
  """The `text_field` of every record of `dataset`, in order; refuses a missing field before yielding."""
  return (texts[0] for texts in dataset_records(dataset, {"--text_field": text_field}, split))


def dataset_conversations(dataset: str, messages_field: str) -> Iterator[list]:
  """The `messages_field` of every record of `dataset`, in order: each a conversation, a list of
  {"role": ..., "content": text}; refuses a missing field or a malformed conversation in one line."""
  return (messages[0] for messages in dataset_records(dataset, {"--messages_field": messages_field},
                                                      read=_messages))


def dataset_completions(dataset: str, prompt_field: str, completion_field: str) -> Iterator[tuple[str, str]]:
  """Each record's (prompt, completion), in order; refuses, in one line, a record that lacks either."""
  return dataset_records(dataset, {"--text_field": prompt_field, "--completion_field": completion_field},
                         read=_present_text)


class PreferencePair(NamedTuple):
  """A prompt with the answer preferred and the answer passed over (objective=dpo's records): three texts, or
  three conversations (lists of messages, TRL's conversational format: the prompt's turns, then each answer's)."""
  prompt: str | list
  chosen: str | list
  rejected: str | list


def dataset_pairs(dataset: str, prompt_field: str, chosen_field: str, rejected_field: str) -> Iterator[PreferencePair]:
  """Each record's PreferencePair, in order; refuses, in one line, a record that lacks one of its parts or
  mixes texts with conversations."""
  fields = {"--text_field": prompt_field, "--chosen_field": chosen_field, "--rejected_field": rejected_field}
  for number, parts in enumerate(dataset_records(dataset, fields, read=_text_or_messages)):
    if len({type(part) for part in parts}) > 1:
      raise ValueError(f"record {number} of {dataset} mixes texts and conversations in {', '.join(fields.values())}; "
                       "give all three as text, or all three as lists of messages.")
    yield PreferencePair(*parts)


def dataset_records(dataset: str, fields: dict[str, str], split: str = "train", read=None) -> Iterator[tuple]:
  """Each record's texts of `fields` ({the flag that names it: a field}), in order, as a tuple (or what
  `read(record, number, file, flag, field)` makes of each field); refuses a missing dataset, or one without
  records, before returning."""
  try:
    import datasets  # optional dependency (pyproject's `data` extra)
  except ImportError as error:
    raise ValueError(f"--dataset={dataset} needs the `datasets` package: pip install -e '.[data]'.") from error
  datasets.disable_progress_bars()
  datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its log would repeat a refusal over lines
  path = Path(dataset).expanduser()
  if path.exists():
    builder, files = _local_files(path)
    # A file at a time, so that a refusal names the file it is about.
    sources = [(str(file), builder, functools.partial(_json_records, str(file)) if builder == "json" else
                functools.partial(datasets.load_dataset, builder, data_files=[str(file)], split="train",
                                  streaming=True)) for file in files]
  else:
    sources = [(dataset, None, functools.partial(datasets.load_dataset, dataset, split=split, streaming=True))]
  texts = _texts(sources, fields, read or _text)
  try:
    first = next(texts, None)
  except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as error:
    raise ValueError(f"--dataset={dataset} is neither a local file or folder nor a dataset the hub serves to "
                     f"this machine ({type(error).__name__}); give a path to parquet, jsonl, arrow, csv or "
                     "text files.") from error
  if first is None:
    raise ValueError(f"--dataset={dataset} holds no records.")
  return itertools.chain([first], texts)


def _texts(sources, fields: dict[str, str], read) -> Iterator[tuple]:
  """`read` of `fields` in every record of every (name, builder, load) in `sources`, in order; empty files
  are skipped."""
  import pyarrow as pa  # a dependency of `datasets`
  import pyarrow.parquet as pq
  for name, builder, load in sources:
    failure = None
    try:
      # `datasets` fails on an empty file and on a parquet file of no rows; neither holds a document.
      if builder and (Path(name).stat().st_size == 0
                      or builder == "parquet" and pq.read_metadata(name).num_rows == 0):
        continue
      for number, record in enumerate(load()):
        yield tuple(read(record, number, name, flag, field) for flag, field in fields.items())
    except UnicodeDecodeError as error:
      number = _first_not_utf8(load, builder)
      failure = _not_utf8(name if number is None else f"record {number} of {name}", error)
    except pa.ArrowInvalid as error:
      failure = (f"{name} cannot be read as {builder or 'a dataset'} ({str(error).splitlines()[0]}); give files "
                 "in the format their names say.")
    # Raised once the handler has let go of the error, whose traceback holds the interrupted reader: as the
    # refusal's context it would live to the interpreter's exit, where the reader's arrow threads abort it.
    if failure:
      raise ValueError(failure)


def _json_records(file: str) -> Iterator[dict]:
  """The records of a json file as written: one JSON object a line, or one array of them.

  Read here, not by `datasets`, which reads a field of mixed types (a number among strings, a message with a
  key the others lack) as JSON text: decoded again, a string such as "42" comes back a number, and where the
  file's first part fixed the field's type (in a file that is one array, or past a long file's first 10 MB)
  every value of the field comes in quotes, so that a bad record is read as a good one."""
  with open(file, "rb") as f:
    if f.read(1 << 16).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
      f.seek(0)
      records = _json_value(f.read(), file)
    else:
      f.seek(0)
      records = (_json_value(line, f"record {number} of {file}")
                 for number, line in enumerate(line for line in f if line.strip()))
    for number, record in enumerate(records):
      if not isinstance(record, dict):
        raise ValueError(f"record {number} of {file} is a {type(record).__name__}, not an object of fields; give "
                         "one JSON object a line, or one array of them.")
      yield record


def _json_value(raw: bytes, where: str):
  try:
    return json.loads(raw.decode("utf-8-sig"))  # a byte order mark may open the file
  except UnicodeDecodeError as error:
    raise ValueError(_not_utf8(where, error)) from None
  except json.JSONDecodeError as error:
    raise ValueError(f"{where} is not JSON ({error}); give one JSON object a line, or one array of them.") from None


def _not_utf8(where: str, error: UnicodeDecodeError) -> str:
  return (f"{where} is not UTF-8 (byte {error.object[error.start]:#04x}: {error.reason}); re-encode the file as "
          "UTF-8, or drop that record.")


def _present_text(record: dict, number: int, name: str, flag: str, field: str) -> str:
  """_text of a field that every record fills: a prompt or completion of null (as parquet and csv give a field a
  record lacks) is no empty document but a record without one."""
  if record.get(field, "") is None:
    raise ValueError(f"record {number} of {name} holds null in {field!r}, not text; give that record its text (an "
                     "empty string will do), or drop it.")
  return _text(record, number, name, flag, field)


def _text(record: dict, number: int, name: str, flag: str, field: str) -> str:
  if field not in record:
    raise ValueError(f"record {number} of {name} has no field {field!r}; its fields are "
                     f"{', '.join(sorted(record))}: pass one as {flag}, or drop that record.")
  text = record[field]
  if text is not None and not isinstance(text, str):  # None: an empty cell, an empty document
    raise ValueError(f"record {number} of {name} has a {type(text).__name__} in {field!r}, not "
                     f"text; pass the field that holds each document's text as {flag}, or drop that record.")
  return text or ""


def _text_or_messages(record: dict, number: int, name: str, flag: str, field: str) -> str | list:
  """A field that holds text or a conversation (a list of messages)."""
  if isinstance(record.get(field), list):
    return _messages(record, number, name, flag, field)
  return _present_text(record, number, name, flag, field)


def _messages(record: dict, number: int, name: str, flag: str, field: str) -> list:
  if field not in record:
    raise ValueError(f"record {number} of {name} has no field {field!r}; its fields are "
                     f"{', '.join(sorted(record))}: pass the one holding the conversation as {flag}, or drop "
                     "that record.")
  messages = record[field]
  well_formed = isinstance(messages, list) and messages and all(
      isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
  if not well_formed:
    raise ValueError(f"record {number} of {name} holds {str(messages)[:60]!r} in {field!r}, not a conversation; "
                     f"{flag} names a list of messages, each {{\"role\": ..., \"content\": text}}.")
  return [{"role": m["role"], "content": m["content"]} for m in messages]


def _first_not_utf8(load, builder: str | None) -> int | None:
  """The number of the first record of `load()` that is not UTF-8, found by reading it again."""
  # latin-1 gives every byte a character, so that text and csv files read through; the other
  # builders hand their bytes on to arrow unchecked, and only converting them to Python decodes.
  latin1 = builder in DECODED_AS_READ
  options = {"encoding": "latin-1"} if latin1 else {}
  number = 0
  for table in load(**options).with_format("arrow").iter(batch_size=LOCATE_BATCH):
    if not _decodes(table, latin1):
      return number + next(row for row in range(table.num_rows) if not _decodes(table.slice(row, 1), latin1))
    number += table.num_rows
  return None  # not in a record: say, in a csv file's header


def _decodes(table, latin1: bool) -> bool:
  """Whether every text of `table` is UTF-8 (read as latin-1, when `latin1`)."""
  try:
    records = table.to_pylist()
    if latin1:
      for text in (value for record in records for value in record.values() if isinstance(value, str)):
        text.encode("latin-1").decode("utf-8")
  except UnicodeDecodeError:
    return False
  return True


def _local_files(path: Path) -> tuple[str, list[Path]]:
  """(the `datasets` builder, the files) of a local dataset: one file, or a folder's files of one format."""
  files = [path] if path.is_file() else sorted(
      p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FORMATS
      and not any(part.startswith(".") for part in p.relative_to(path).parts))
  builders = {FORMATS.get(f.suffix.lower()) for f in files}
  if not files or None in builders:
    raise ValueError(f"--dataset={path} holds no {', '.join(FORMATS)} files; give a file or folder of them.")
  if len(builders) > 1:
    raise ValueError(f"--dataset={path} mixes formats ({', '.join(sorted(builders))}); give a folder of one.")
  return builders.pop(), files
