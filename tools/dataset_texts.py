"""Documents from one field of a dataset, read through Hugging Face `datasets` (the `data` extra).

A local file or folder of parquet, jsonl/json, arrow, csv or text files (one
format per dataset; a text file's rows are its lines), or, on a machine that
reaches the hub, a dataset's name. Everything is streamed, so a corpus larger
than memory works; JSON and parquet are read as records, never as raw text.
"""

from pathlib import Path
from typing import Iterator

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv",
           ".txt": "text"}


def dataset_texts(dataset: str, text_field: str, split: str = "train") -> Iterator[str]:
  """The `text_field` of every record of `dataset`, in order; refuses a missing field before yielding."""
  try:
    import datasets  # optional dependency (pyproject's `data` extra)
  except ImportError as error:
    raise ValueError(f"--dataset={dataset} needs the `datasets` package: pip install -e '.[data]'.") from error
  datasets.disable_progress_bars()
  path = Path(dataset).expanduser()
  try:
    if path.exists():
      builder, files = _local_files(path)
      records = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True)
    else:
      records = datasets.load_dataset(dataset, split=split, streaming=True)
    first = next(iter(records), None)
  except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as error:
    raise ValueError(f"--dataset={dataset} is neither a local file or folder nor a dataset the hub serves to "
                     f"this machine ({type(error).__name__}); give a path to parquet, jsonl, arrow, csv or "
                     "text files.") from error
  if first is None:
    raise ValueError(f"--dataset={dataset} holds no records.")
  if text_field not in first:
    raise ValueError(f"--dataset={dataset} has no field {text_field!r}; its fields are "
                     f"{', '.join(sorted(first))}: pass one as --text_field.")
  return _texts(records, dataset, text_field)


def _texts(records, dataset: str, text_field: str) -> Iterator[str]:
  for number, record in enumerate(records):
    text = record[text_field]
    if text is not None and not isinstance(text, str):  # None: an empty cell, an empty document
      raise ValueError(f"--dataset={dataset} record {number} has a {type(text).__name__} in {text_field!r}, "
                       "not text; pass the field that holds each document's text as --text_field.")
    yield text or ""


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
