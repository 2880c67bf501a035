"""The built-in corpus: text every machine with Python already has, byte-tokenized and cached."""

import os
import platform
import sysconfig
from pathlib import Path

import numpy as np
import pydoc_data.topics

from input_pipeline.token_files import read_meta, write_token_folder

BUILTIN_RECIPE = "python-stdlib-sources+pydoc-topics/v1"
BUILTIN_MAX_TOKENS = 16 * 2**20
BUILTIN_VAL_FRACTION = 0.05
SKIPPED_STDLIB_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


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
