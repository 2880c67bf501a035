"""Hugging Face tokenizers: --tokenizer=hf:DIR in prepare, init_from's own tokenizer, and exports that carry it."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from helpers import END_OF_TEXT, byte_level_bpe, data_config, run_reference, tiny_config, write_corpus
from input_pipeline import data, prepare
from input_pipeline.tokenizer import load_tokenizer, run_tokenizer
from interop.export import export
from training.checkpoint import Checkpoints
from training.state import init_state, plan

END = END_OF_TEXT


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  """A byte-level BPE of at most 300 tokens trained here on a few sentences, saved as a Hugging Face directory."""
  folder = tmp_path_factory.mktemp("tokenizer")
  bpe = byte_level_bpe(["the mesh trains the model", "héllo wörld, 日本", "print('hello')"] * 20, 300)
  bpe.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": END}))
  return folder


def test_an_hf_tokenizer_round_trips_text_and_names_its_end_of_text(tokenizer_dir):
  tok = load_tokenizer(f"hf:{tokenizer_dir}")
  text = "héllo wörld, 日本 and print('x')"
  ids = tok.encode(text)
  assert tok.name == f"hf:{tokenizer_dir.resolve()}" and ids.dtype == np.int32 and len(ids) < len(text.encode())
  assert tok.decode(ids) == text
  assert tok.end_of_text == Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(END)
  assert tok.decode([ids[0], tok.vocab_size + 5, ids[1]]).count("\ufffd") == 1


def test_a_folder_without_tokenizer_json_is_refused_in_one_line(tmp_path):
  with pytest.raises(ValueError, match=r"^tokenizer hf:.* has no tokenizer.json; give a directory"):
    load_tokenizer(f"hf:{tmp_path}")


def test_prepare_with_an_hf_tokenizer_writes_its_ids(tokenizer_dir, tmp_path):
  texts = write_corpus(tmp_path / "text")
  _, meta = prepare.prepare(tmp_path / "text", tmp_path / "out", tokenizer_name=f"hf:{tokenizer_dir}",
                            val_fraction=0.0)
  tok = load_tokenizer(f"hf:{tokenizer_dir}")
  assert meta["tokenizer"] == tok.name and meta["vocab_size"] == tok.vocab_size
  expected = np.concatenate([np.append(tok.encode(text), tok.end_of_text) for text in texts])
  np.testing.assert_array_equal(data.open_split(data_config(path=tmp_path / "out"), "train",
                                                vocab_size=512).tokens, expected)


def test_init_from_uses_its_own_tokenizer_and_refuses_data_another_wrote(tokenizer_dir, tmp_path):
  checkpoint = tmp_path / "checkpoint"
  shutil.copytree(tokenizer_dir, checkpoint)  # a checkpoint directory holding the same tokenizer
  own = run_tokenizer(f"hf:{checkpoint}", "byte", "synthetic")
  assert own.name == f"hf:{checkpoint.resolve()}"
  # Token data written with the same tokenizer.json elsewhere is the same tokenizer.
  assert run_tokenizer(f"hf:{checkpoint}", f"hf:{tokenizer_dir}", "data/corpus").same_as(own)
  with pytest.raises(ValueError, match=r"^data/corpus holds byte tokens, but init_from=hf:.* has its own "
                                       r"tokenizer; prepare the text with `python tools/prepare.py "
                                       r"--tokenizer=hf:.*"):
    run_tokenizer(f"hf:{checkpoint}", "byte", "data/corpus")
  assert run_tokenizer("", "byte", "data/corpus").name == "byte"


def test_export_carries_the_tokenizer_the_text_went_through_and_writes_bf16(tokenizer_dir, tmp_path):
  write_corpus(tmp_path / "text")
  prepare.prepare(tmp_path / "text", tmp_path / "tokens", tokenizer_name=f"hf:{tokenizer_dir}", val_fraction=0.0)
  tok = load_tokenizer(f"hf:{tokenizer_dir}")
  config = tiny_config(**{"mesh.data": 1, "data.source": "tokens", "data.path": str(tmp_path / "tokens"),
                          "workdir": str(tmp_path / "run"), "model.vocab_size": tok.vocab_size})
  layout = plan(config, jax.devices()[:1])
  checkpoints = Checkpoints(config.workdir, every=0, keep=1)
  checkpoints.save_now(0, init_state(layout, config.seed), config)
  checkpoints.close()
  export(config.workdir, str(tmp_path / "exported"))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "exported" / name).read_bytes() == (tokenizer_dir / name).read_bytes()
  assert json.loads((tmp_path / "exported" / "config.json").read_text())["dtype"] == "float32"
  # bfloat16: the same weights rounded, and config.json says so.
  export(config.workdir, str(tmp_path / "bf16"), dtype="bfloat16")
  full, half = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("exported", "bf16"))
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
  assert sorted(full) == sorted(half) and all(half[k].dtype == ml_dtypes.bfloat16 for k in half)
  for key in full:
    np.testing.assert_array_equal(half[key], full[key].astype(ml_dtypes.bfloat16))
  # transformers opens the export as a complete model: its tokenizer gives meshlm's ids, and the model runs.
  texts = ["héllo wörld, 日本", "the mesh trains the model"]
  np.save(tmp_path / "tokens.npy", np.stack([tok.encode(texts[1])[:4]] * 2))
  run_reference([{"tokenize": str(tmp_path / "exported"), "texts": texts, "out": str(tmp_path / "ids.json")},
                 {"logits": str(tmp_path / "exported"), "tokens": str(tmp_path / "tokens.npy"),
                  "out": str(tmp_path / "logits.npy")}], tmp_path)
  reference = json.loads((tmp_path / "ids.json").read_text())
  assert reference == {"ids": [tok.encode(text).tolist() for text in texts], "eos": tok.end_of_text}
  assert np.load(tmp_path / "logits.npy").shape == (2, 4, tok.vocab_size)


# ChatML, as Qwen's chat models write their turns, after a beginning-of-sequence token.
CHATML = ("{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "the mesh trains"}, {"role": "user", "content": "héllo wörld"},
     {"role": "assistant", "content": "print('hello')"}, {"role": "user", "content": "日本"},
     {"role": "assistant", "content": "the model"}],
    [{"role": "user", "content": "the model"}, {"role": "assistant", "content": "héllo"}],
]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tokenizer_dir, tmp_path_factory):
  """tokenizer_dir's BPE with ChatML's special tokens and template, as a chat model's directory holds it."""
  folder = tmp_path_factory.mktemp("chat")
  bpe = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
  bpe.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
  bpe.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": END, "bos_token": "<s>", "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
  return folder


def test_chat_records_are_rendered_as_transformers_renders_them_and_only_answers_are_scored(chat_tokenizer_dir,
                                                                                            tmp_path):
  (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
  prepare.prepare(None, tmp_path / "out", tokenizer_name=f"hf:{chat_tokenizer_dir}", val_fraction=0.0,
                  dataset=str(tmp_path / "chats.jsonl"), messages_field="messages")
  split = data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=512)
  run_reference([{"chat": str(chat_tokenizer_dir), "conversations": CONVERSATIONS,
                  "out": str(tmp_path / "chat.json")}], tmp_path)
  reference = json.loads((tmp_path / "chat.json").read_text())
  tok = load_tokenizer(f"hf:{chat_tokenizer_dir}")
  # The ids are transformers' apply_chat_template ids, each conversation followed by the end-of-text.
  np.testing.assert_array_equal(split.tokens, np.concatenate([r["ids"] + [tok.end_of_text] for r in reference]))
  # Scored: each assistant turn's content and its end-of-turn, and the end-of-text after a final answer.
  scored = tok.decode(np.where(split.mask, split.tokens, tok.vocab_size))
  assert [run for run in scored.split("\ufffd") if run] == ["print('hello')<|im_end|>\n", "the model<|im_end|>\n<|endoftext|>",
                                    "héllo<|im_end|>\n<|endoftext|>"]


def test_chat_records_need_a_chat_template_and_conversations(tokenizer_dir, chat_tokenizer_dir, tmp_path):
  (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "text": "hi"}]}) + "\n")
  (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
  run = lambda tokenizer_name, records: prepare.prepare(
      None, tmp_path / "out", tokenizer_name=tokenizer_name, dataset=str(tmp_path / records), messages_field="messages")
  with pytest.raises(ValueError, match=r"^--messages_field renders the tokenizer's chat template, which "
                                       r"--tokenizer=byte lacks; give the chat model's as --tokenizer=hf:DIR\.$"):
    run("byte", "chats.jsonl")
  with pytest.raises(ValueError, match=r"tokenizer_config.json has no chat_template; --messages_field needs the "
                                       r"tokenizer of a chat model"):
    run(f"hf:{tokenizer_dir}", "chats.jsonl")
  with pytest.raises(ValueError, match=r"^record 0 of .*bad.jsonl holds .* in 'messages', not a conversation; "
                                       r"--messages_field names a list of messages"):
    run(f"hf:{chat_tokenizer_dir}", "bad.jsonl")
  # A template that marks the last turn renders earlier turns differently once another follows.
  shutil.copytree(chat_tokenizer_dir, tmp_path / "last")
  config = json.loads((tmp_path / "last" / "tokenizer_config.json").read_text())
  config["chat_template"] = "{% for m in messages %}{% if loop.last %}>{% endif %}{{ m['content'] }}{% endfor %}"
  (tmp_path / "last" / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"^the conversation that begins 'the model': its chat template renders "
                                       r"earlier turns differently once later ones follow"):
    run(f"hf:{tmp_path / 'last'}", "chats.jsonl")
  assert not (tmp_path / "out").exists()


def test_conversational_preference_pairs_score_only_each_answer(chat_tokenizer_dir, tmp_path):
  prompt = CONVERSATIONS[0][:3]  # a user turn, an assistant turn, then the user's question
  records = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "the model"}],
              "rejected": [{"role": "assistant", "content": "héllo"}]}]
  (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  prepare.prepare(None, tmp_path / "out", tokenizer_name=f"hf:{chat_tokenizer_dir}", val_fraction=0.0,
                  dataset=str(tmp_path / "pairs.jsonl"), text_field="prompt", chosen_field="chosen",
                  rejected_field="rejected")
  split = data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=512)
  tok = load_tokenizer(f"hf:{chat_tokenizer_dir}")
  (first, middle, stop), = split.pairs
  for (start, end), answer in (((first, middle), "the model"), ((middle, stop), "héllo")):
    tokens, mask = split.tokens[start:end], split.mask[start:end]
    assert tok.decode(tokens).startswith(tok.decode(split.tokens[first:first + 5]))  # the prompt, rendered again
    # Scored: the answer's turn and the end-of-text, not the prompt's own assistant turn (print('hello')).
    assert tok.decode(np.where(mask, tokens, tok.vocab_size)).replace("\ufffd", "") == \
        f"{answer}<|im_end|>\n<|endoftext|>"
  (tmp_path / "mixed.jsonl").write_text(json.dumps({**records[0], "rejected": "héllo"}) + "\n")
  with pytest.raises(ValueError, match=r"mixes texts and conversations"):
    prepare.prepare(None, tmp_path / "mixed", tokenizer_name=f"hf:{chat_tokenizer_dir}",
                    dataset=str(tmp_path / "mixed.jsonl"), text_field="prompt", chosen_field="chosen",
                    rejected_field="rejected")
