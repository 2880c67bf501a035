"""Tokenizes a folder of text into the token folder that `--config.data.source=tokens` reads.

  python tools/prepare.py --input ~/corpus --output data/corpus --tokenizer byte
  python tools/prepare.py --input ~/corpus --output data/corpus --tokenizer hf:checkpoints/llama   # its tokenizer.json

Reads every file under --input whose suffix is in TEXT_SUFFIXES (recursively, sorted by
path; hidden files and folders skipped) as UTF-8, undecodable bytes replaced by U+FFFD.
Each file is one document, followed by the tokenizer's end-of-text: a newline for `byte`,
<|endoftext|> for `gpt2`, the tokenizer's eos_token for `hf:DIR`. The last --val_fraction of the tokens is the val split. Writes
train.bin, val.bin and meta.json (format: training/token_files.py), each whole or not at all.
"""

import sys
from pathlib import Path

# `python tools/prepare.py` puts tools/ on sys.path, not the repo root that holds training/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position

from training import token_files, tokenizer  # pylint: disable=wrong-import-position

# Plain-text formats; anything else (images, archives, .bin) is skipped rather than sniffed,
# so what goes into a dataset never depends on a guess about a file's contents.
TEXT_SUFFIXES = frozenset((
    ".txt", ".md", ".rst", ".tex", ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go",
    ".java", ".js", ".ts", ".sh", ".html", ".xml", ".css", ".json", ".jsonl", ".csv",
    ".tsv", ".yaml", ".yml", ".toml"))

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
            overwrite: bool = False) -> tuple[int, dict]:
  """Tokenizes `input_dir` into `output_dir`; returns (files read, meta)."""
  input_dir, output_dir = Path(input_dir).expanduser(), Path(output_dir).expanduser()
  if not input_dir.is_dir():
    raise ValueError(f"Input folder {input_dir} does not exist.")
  if not 0 <= val_fraction < 1:
    raise ValueError(f"--val_fraction={val_fraction} must be in [0, 1).")
  # A dataset inside its own input folder must not be read back in on the next run.
  if output_dir.exists() and not output_dir.is_dir():
    raise ValueError(f"--output={output_dir} is a file, not a folder; give a folder for train.bin, "
                     "val.bin and meta.json.")
  files = text_files(input_dir, skip=output_dir)
  if not files:
    raise ValueError(f"{input_dir} holds no text files ({' '.join(sorted(TEXT_SUFFIXES))}).")
  existing = [name for name in token_files.FOLDER_FILES if (output_dir / name).exists()]
  if existing and not overwrite:
    raise ValueError(f"{output_dir} already holds a prepared dataset ({', '.join(existing)}); "
                     "pass --overwrite to replace it.")
  tok = tokenizer.load_tokenizer(tokenizer_name)
  separator = np.array([tok.end_of_text], np.int32)
  # Decoding bytes (not read_text) keeps "\r\n" as written: the text round-trips exactly.
  chunks = (np.concatenate([tok.encode(path.read_bytes().decode("utf-8", errors="replace")),
                            separator])
            for path in files)
  meta = token_files.write_token_folder(output_dir, chunks, tokenizer=tok.name,
                                 vocab_size=tok.vocab_size, val_fraction=val_fraction)
  return len(files), meta


def define_flags():
  """Defines the command line; only when run, so importing prepare() leaves global flags alone."""
  flags.DEFINE_string("input", None, "Folder of text files, read recursively.", required=True)
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
  try:
    num_files, meta = prepare(args.input, args.output, tokenizer_name=args.tokenizer,
                              val_fraction=args.val_fraction, overwrite=args.overwrite)
  except ValueError as error:
    sys.exit(f"prepare.py: {error}")  # one line on stderr, exit status 1
  total = meta["train_tokens"] + meta["val_tokens"]
  print(f"Prepared {args.output} from {num_files} text file{'s' * (num_files != 1)}: "
        f"{total:,} {meta['tokenizer']} tokens, {meta['train_tokens']:,} train / "
        f"{meta['val_tokens']:,} val.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
