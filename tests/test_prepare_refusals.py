"""tools/prepare.py refuses what it cannot tokenize in one line, writes nothing, and loses no dataset already there."""

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models

from helpers import END_OF_TEXT, ROOT, byte_level_bpe, write_corpus
from input_pipeline import prepare

NOT_UTF8 = [b"fine", b"also fine", b"caf\xff au lait", b"fine again"]  # record 2 is not UTF-8


def parquet_of(path, values, type_=pa.string()):
  """Writes `values` (bytes) as the text column, unvalidated: a string column may hold what is not UTF-8."""
  raw = pa.array(values, pa.binary())
  pq.write_table(pa.table({"text": pa.Array.from_buffers(type_, len(raw), raw.buffers())}), path)


def tokenizer_with_a_bad_config(d):
  (d / "tok").mkdir()
  Tokenizer(models.WordLevel({"a": 0, "<|endoftext|>": 1}, unk_token="a")).save(str(d / "tok" / "tokenizer.json"))
  (d / "tok" / "tokenizer_config.json").write_text('{"eos_token": ')


def records(path, count=101, change=lambda number, record: None, array=False):
  """Writes `count` prompt and completion records, each first given to `change`: as JSON lines, or one array."""
  written = []
  for number in range(count):
    written.append({"prompt": f"{number} + 1 = ", "completion": str(number + 1)})
    change(number, written[-1])
  path.write_text(json.dumps(written) if array else "".join(json.dumps(record) + "\n" for record in written))


def chat_tokenizer(d):
  """A byte-level BPE with a plain chat template: each turn its role, a colon and its content on a line."""
  (d / "chat").mkdir()
  byte_level_bpe(["system: be brief", "user: hi", "assistant: hello"], 300).save(str(d / "chat" / "tokenizer.json"))
  (d / "chat" / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT, "chat_template": (
      "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
      "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")}))


def conversations(d, name, change):
  """chat_tokenizer's folder, and 101 conversations of a user's turn and the assistant's as a JSON array,
  each first given to `change`."""
  chat_tokenizer(d)
  (d / name).write_text(json.dumps([{"messages": change(n, [{"role": "user", "content": f"{n} + 1?"},
                                                              {"role": "assistant", "content": str(n + 1)}])}
                                     for n in range(101)]))


def bad_parquet_folder(d):
  (d / "shards").mkdir()
  parquet_of(d / "shards" / "a.parquet", [b"first shard"] * 3)
  parquet_of(d / "shards" / "b.parquet", NOT_UTF8)


CASES = {  # name: (make the input under d, the flags, the refusal)
    "a parquet file as --input": (
        lambda d: parquet_of(d / "records.parquet", [b"text"]), ["--input={d}/records.parquet"],
        r"--input=.*/records\.parquet is a file; --input takes a folder of text files \(each one a document\), "
        r"--dataset a file or folder of records \(\.parquet .*\) with --text_field"),
    "a tokenizer.json that does not parse": (
        lambda d: (d / "tok").mkdir() or (d / "tok" / "tokenizer.json").write_text('{"model": '),
        ["--input={d}/text", "--tokenizer=hf:{d}/tok"],
        r"tokenizer hf:.*/tok: .*/tok/tokenizer\.json does not parse \(EOF while parsing a value at line 1 "
        r"column 10\); give the tokenizer\.json that Tokenizer\.save or save_pretrained writes\."),
    "a tokenizer_config.json that is not JSON": (
        tokenizer_with_a_bad_config, ["--input={d}/text", "--tokenizer=hf:{d}/tok"],
        r"tokenizer hf:.*/tok: .*/tok/tokenizer_config\.json is not a JSON object \(Expecting value: line 1 "
        r"column 15 \(char 14\)\); give the tokenizer_config\.json that save_pretrained writes\."),
    "a parquet file of no rows": (
        lambda d: parquet_of(d / "empty.parquet", []), ["--dataset={d}/empty.parquet"],
        r"--dataset=.*/empty\.parquet holds no records\."),
    "jsonl not UTF-8, two workers": (
        lambda d: (d / "r.jsonl").write_bytes(b"".join(b'{"text": "%s"}\n' % v for v in NOT_UTF8)),
        ["--dataset={d}/r.jsonl", "--workers=2"], r"record 2 of .*/r\.jsonl is not UTF-8"),
    "a parquet folder's second file not UTF-8": (
        bad_parquet_folder, ["--dataset={d}/shards"], r"record 2 of .*/shards/b\.parquet is not UTF-8"),
    "lines not UTF-8": (
        lambda d: (d / "r.txt").write_bytes(b"\n".join(NOT_UTF8)), ["--dataset={d}/r.txt"],
        r"record 2 of .*/r\.txt is not UTF-8"),
    "csv not UTF-8": (
        lambda d: (d / "r.csv").write_bytes(b"text\n" + b"\n".join(NOT_UTF8)), ["--dataset={d}/r.csv"],
        r"record 2 of .*/r\.csv is not UTF-8"),
    # Every record is checked, not the first alone.
    "record 50 of 101 without its completion": (
        lambda d: records(d / "r.jsonl", change=lambda n, r: n == 50 and r.pop("completion")),
        ["--dataset={d}/r.jsonl", "--text_field=prompt", "--completion_field=completion"],
        r"record 50 of .*/r\.jsonl has no field 'completion'; its fields are prompt: pass one as "
        r"--completion_field, or drop that record\.$"),
    "record 50 of 101 with a null prompt": (
        lambda d: records(d / "r.jsonl", change=lambda n, r: n == 50 and r.update(prompt=None)),
        ["--dataset={d}/r.jsonl", "--text_field=prompt", "--completion_field=completion"],
        r"record 50 of .*/r\.jsonl holds null in 'prompt', not text; give that record its text \(an empty "
        r"string will do\), or drop it\.$"),
    # One JSON array: `datasets` turns a field of mixed types into JSON text, and hands that text on.
    "an int completion in record 30 of a JSON array": (
        lambda d: records(d / "r.json", change=lambda n, r: n == 30 and r.update(completion=31), array=True),
        ["--dataset={d}/r.json", "--text_field=prompt", "--completion_field=completion"],
        r"record 30 of .*/r\.json has a int in 'completion', not text"),
    "text for a conversation in record 30 of a JSON array": (
        lambda d: conversations(d, "c.json", lambda n, m: "31" if n == 30 else m),
        ["--dataset={d}/c.json", "--messages_field=messages", "--tokenizer=hf:{d}/chat"],
        r"record 30 of .*/c\.json holds '31' in 'messages', not a conversation"),
    "conversations of system turns alone": (
        lambda d: conversations(d, "c.json", lambda n, m: [{"role": "system", "content": m[0]["content"]}]),
        ["--dataset={d}/c.json", "--messages_field=messages", "--tokenizer=hf:{d}/chat"],
        r"the train split of .*/out would score none of its [\d,]+ tokens: no assistant turn or completion "
        r"falls in it, so its loss would be 0 at every step and teach nothing; give records whose answers are "
        r"scored\.$"),
    "a val split past the last answer": (
        lambda d: conversations(d, "c.json", lambda n, m: m if n < 50 else m[:1]),
        ["--dataset={d}/c.json", "--messages_field=messages", "--tokenizer=hf:{d}/chat", "--val_fraction=0.2"],
        r"the val split of .*/out would score none of its [\d,]+ tokens: no assistant turn or completion "
        r"falls in it, so its loss would be 0 at every step and teach nothing; give records whose answers are "
        r"scored, or a --val_fraction whose tail holds some\.$"),
}


def snapshot(folder):
  return {path.name: path.read_bytes() for path in folder.iterdir()}


def refusal(result) -> str:
  """The line prepare.py refused with; the only other output allowed is the progress bar's."""
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  lines = [line for line in re.split(r"[\r\n]", result.stderr) if line.strip()]
  assert all(re.fullmatch(r"\S+ tokens \[.*tokens/s\]", line) for line in lines[:-1]), lines
  assert lines[-1].startswith("prepare.py: ")
  return lines[-1].removeprefix("prepare.py: ")


def run_prepare(*flags):
  return subprocess.run([sys.executable, "tools/prepare.py", *flags], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, check=False)


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_is_refused_in_one_line_and_the_dataset_there_kept(case, tmp_path):
  make, flags, message = CASES[case]
  write_corpus(tmp_path / "text")
  prepare.prepare(tmp_path / "text", tmp_path / "out")  # what --overwrite would replace
  kept = snapshot(tmp_path / "out")
  make(tmp_path)
  result = run_prepare(*(flag.format(d=tmp_path) for flag in flags), f"--output={tmp_path}/out", "--overwrite")
  assert re.match(message, refusal(result))
  assert snapshot(tmp_path / "out") == kept  # no temporary file left, nothing replaced


def test_a_full_disk_is_refused_in_one_line_and_the_dataset_there_kept(small_disk, tmp_path):
  (tmp_path / "big").mkdir()
  (tmp_path / "big" / "a.txt").write_text("x" * 600_000)  # 1.1 MiB of byte tokens, on a 0.7 MiB disk
  write_corpus(tmp_path / "text")
  prepare.prepare(tmp_path / "text", small_disk / "out")
  kept = snapshot(small_disk / "out")
  for output in ("out", "new"):
    line = refusal(run_prepare(f"--input={tmp_path}/big", f"--output={small_disk}/{output}", "--overwrite"))
    assert re.fullmatch(rf"the disk holding {small_disk}/{output} is full \(No space left on device\): the tokens "
                        r"need at least 1\.1 MiB and 0\.[5-7] MiB are free; nothing was written and the folder is "
                        r"as it was: make room, then run the same command again\.", line), line
  assert snapshot(small_disk / "out") == kept and sorted(p.name for p in small_disk.iterdir()) == ["out"]
