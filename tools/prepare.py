"""Tokenizes a folder of text, or one field of a dataset, into the token folder `--config.data.source=tokens` reads.

  python tools/prepare.py --input ~/corpus --output data/corpus --tokenizer byte
  python tools/prepare.py --input ~/corpus --output data/corpus --tokenizer hf:checkpoints/llama   # its tokenizer.json
  python tools/prepare.py --dataset data/raw/shards --text_field text --output data/corpus --workers 8
  python tools/prepare.py --dataset instructions.jsonl --text_field prompt --completion_field completion --output data/sft
  python tools/prepare.py --dataset chats.jsonl --messages_field messages --tokenizer hf:checkpoints/qwen --output data/sft
  python tools/prepare.py --dataset pairs.jsonl --text_field prompt --chosen_field chosen --rejected_field rejected --output data/dpo

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
--chosen_field and --rejected_field (with --dataset) prepare preference pairs for objective=dpo: each record's
--text_field (the prompt) with each of the two answers, tokenized as a prompt and completion are, the answers'
tokens the ones scored; the last --val_fraction of the pairs (not tokens) is the val split, and train.pairs /
val.pairs hold where each pair lies.
"""

import gc
import sys

from absl import app, flags, logging

from input_pipeline.prepare import prepare


def define_flags():
  """Defines the command line; only when run, so importing this tool leaves global flags alone."""
  flags.DEFINE_string("input", None, "Folder of text files, read recursively (or give --dataset).")
  flags.DEFINE_string("dataset", None, "Local parquet/jsonl/arrow/csv/text file or folder, or a hub dataset name.")
  flags.DEFINE_string("text_field", "text", "With --dataset: the field holding each document's text (with "
                      "--completion_field, the prompt's).")
  flags.DEFINE_string("completion_field", None, "With --dataset: the field holding each record's completion, "
                      "the only tokens the loss scores (fine-tuning on completions).")
  flags.DEFINE_string("messages_field", None, "With --dataset: the field holding each record's conversation "
                      "(a list of role/content messages), rendered with the --tokenizer=hf:DIR chat template; "
                      "the assistant's turns are the only tokens the loss scores.")
  flags.DEFINE_string("chosen_field", None, "With --dataset and --rejected_field: the field holding the answer "
                      "preferred to the --text_field prompt (preference pairs, objective=dpo).")
  flags.DEFINE_string("rejected_field", None, "With --dataset and --chosen_field: the field holding the answer "
                      "passed over.")
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
                              messages_field=args.messages_field, chosen_field=args.chosen_field,
                              rejected_field=args.rejected_field,
                              workers=args.workers, progress=True)
  except ValueError as error:
    # A refusal can leave a dataset reader mid-file: collected now, its arrow threads stop while the
    # interpreter still runs, instead of aborting it on the way out.
    gc.collect()
    sys.exit(f"prepare.py: {error}")  # one line on stderr, exit status 1
  total = meta["train_tokens"] + meta["val_tokens"]
  print(f"Prepared {args.output} from {num_files} document{'s' * (num_files != 1)}: "
        f"{total:,} {meta['tokenizer']} tokens, {meta['train_tokens']:,} train / "
        f"{meta['val_tokens']:,} val" + (f" ({meta['train_pairs']:,} / {meta['val_pairs']:,} preference pairs)."
                                          if meta.get("pairs") else "."))


if __name__ == "__main__":
  define_flags()
  app.run(main)
