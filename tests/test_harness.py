"""lm-evaluation-harness through meshlm's model class (interop/harness.py) against the harness's own Hugging Face class.

A GPT-2-shaped and a Llama-shaped checkpoint, random and tiny, are built by transformers (tests/hf_reference.py)
with a byte-level BPE tokenizer saved beside them. Four local tasks, one per kind of request the harness makes
(multiple choice, a LAMBADA-style last word, rolling log-likelihood, greedy generation), run through
`lm_eval.simple_evaluate` twice: with meshlm's class on data=4 x tensor=2, here, and with the harness's `hf`
model in the transformers sidecar. Every document's responses agree: log-likelihoods to 1e-5 relative (float32
on both sides, differing in the order of reductions), greedy flags and generated text exactly; and so every
metric, to the same 1e-5.
"""

import functools
import json
import subprocess
import sys

import jax
import lm_eval.tasks
import numpy as np
import pytest
from absl import flags

from helpers import END_OF_TEXT, ROOT, byte_level_bpe, run_reference, tiny_config
from input_pipeline import data, prepare
from interop import hf_checkpoint
from interop.harness import MeshlmLM, from_hf, split_perplexity
from interop.harness_tasks import evaluate, task_manager
from tools import evaluate as evaluate_tool
from training.checkpoint import Checkpoints
from training.state import plan, state_from_params
from training.step import make_eval_step

WORDS = "the mesh trains the model on every device and the model learns the words of the mesh".split()
MAX_LEN = 32  # both models' context, and HFLM's max_length: the rolling windows must be the same
MODELS = {  # name: (hf_reference family, transformers config)
    "gpt2": ("gpt2", dict(vocab_size=300, n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=2, n_inner=64)),
    "llama": ("llama", dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                            tie_word_embeddings=False)),
}
TASKS = ("meshlm_choice", "meshlm_last_word", "meshlm_rolling", "meshlm_generate")


def sentence(rng, n):
  return " ".join(rng.choice(WORDS, n))


def write_tasks(folder):
  rng = np.random.default_rng(0)
  records = {
      "choice": [{"question": sentence(rng, 4), "choices": [sentence(rng, 2) for _ in range(3)], "answer": i % 3}
                 for i in range(6)],
      "last_word": [{"text": sentence(rng, 6)} for _ in range(6)],
      "rolling": [{"text": sentence(rng, 40)} for _ in range(2)],  # longer than one 32-token window
      "generate": [{"prompt": sentence(rng, 4), "answer": sentence(rng, 1)} for _ in range(3)],
  }
  kinds = {
      "choice": ("multiple_choice", "{{question}}", "{{answer}}",
                 "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
      "last_word": ("loglikelihood", "{{text.split(' ')[:-1]|join(' ')}}", "{{' ' + text.split(' ')[-1]}}",
                    "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
                    "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"),
      "rolling": ("loglikelihood_rolling", "''", "{{text}}",
                  "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                  "  - metric: bits_per_byte\n"),
      "generate": ("generate_until", "{{prompt}}", "{{answer}}",
                   "generation_kwargs:\n  until: ['the']\n  do_sample: false\n  max_gen_toks: 6\n"
                   "metric_list:\n  - metric: exact_match\n"),
  }
  for name, (output_type, text, target, rest) in kinds.items():
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[name]))
    (folder / f"{name}.yaml").write_text(
        f"task: meshlm_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\noutput_type: {output_type}\ndoc_to_text: \"{text}\"\ndoc_to_target: \"{target}\"\n"
        + rest)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """The two checkpoint directories (with the tokenizer), the task folder and the harness's own results."""
  where = tmp_path_factory.mktemp("harness")
  bpe = byte_level_bpe([" ".join(WORDS)] * 20, 290)
  (where / "tasks").mkdir()
  write_tasks(where / "tasks")
  run_reference([{"make": family, "dir": str(where / name), "config": config, "seed": i, "save": {}}
                 for i, (name, (family, config)) in enumerate(MODELS.items())], where)
  jobs = []
  for name in MODELS:
    # The Llama's tokenizer names a beginning-of-sequence token, which both classes put before a text's first
    # rolling window; GPT-2's names none, and the end-of-text goes there. Both vocabularies are larger than
    # the tokenizer's, so the random models also generate ids that are no token.
    bos = {"bos_token": "<s>"} if name == "llama" else {}
    bpe.add_special_tokens(["<s>"])  # in both, and special: a generated one is left out of the answer
    bpe.save(str(where / name / "tokenizer.json"))
    (where / name / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": END_OF_TEXT, "tokenizer_class": "PreTrainedTokenizerFast", **bos}))
    jobs.append({"harness": str(where / name), "tasks": list(TASKS), "include_path": str(where / "tasks"),
                 "max_length": MAX_LEN, "out": str(where / f"{name}.json")})
  run_reference(jobs, where)
  return where


def responses(samples):
  """Each document's responses, by document, with tuples as lists (as the sidecar's JSON holds them)."""
  return [json.loads(json.dumps(resps, default=float)) for _, resps in sorted(samples, key=lambda s: s[0])]


def assert_same(ours, theirs, where):
  if isinstance(theirs, list):
    assert isinstance(ours, list) and len(ours) == len(theirs), (where, ours, theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
      assert_same(a, b, f"{where}[{i}]")
  elif isinstance(theirs, float) and not isinstance(theirs, bool):
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, err_msg=where)
  else:
    assert ours == theirs, (where, ours, theirs)


@pytest.mark.parametrize("name", MODELS)
def test_meshlm_scores_as_the_harness_scores_the_exported_model(checkpoints, name):
  config, layout, params, tokenizer = from_hf(f"hf:{checkpoints / name}", {"data": 4, "tensor": 2}, "float32")
  assert config.model.max_len == MAX_LEN and dict(layout.mesh.shape)["tensor"] == 2
  ours = evaluate(MeshlmLM(layout, params, tokenizer, batch_size=4), list(TASKS),
                  task_manager(list(TASKS), str(checkpoints / "tasks")))
  theirs = json.loads((checkpoints / f"{name}.json").read_text())
  for task in TASKS:
    mine = responses([[s["doc_id"], s["resps"]] for s in ours["samples"][task]])
    assert_same(mine, responses(theirs["samples"][task]), f"{name} {task}")
    metrics = {k: v for k, v in theirs["results"][task].items() if k != "alias" and "stderr" not in k}
    assert metrics, theirs["results"][task]
    assert_same([ours["results"][task][k] for k in metrics], list(metrics.values()), f"{name} {task} metrics")
  generated = responses([[s["doc_id"], s["resps"]] for s in ours["samples"]["meshlm_generate"]])
  assert any(answer[0][0] for answer in generated), generated  # the greedy decoder ran and wrote text


def test_evaluate_py_refuses_bad_input_in_one_line(checkpoints, tmp_path):
  run = lambda *flags: subprocess.run([sys.executable, "tools/evaluate.py", *flags], cwd=ROOT, capture_output=True,
                                      text=True, timeout=240)
  both = run(f"--init_from=hf:{checkpoints / 'gpt2'}", "--workdir=runs/x", "--tasks=a")
  assert both.returncode == 1 and both.stderr.strip().splitlines()[-1] == (
      "evaluate.py: give one of --workdir (a meshlm run) and --init_from=hf:DIR (a Hugging Face checkpoint).")
  unknown = run(f"--init_from=hf:{checkpoints / 'gpt2'}", "--tasks=no_such_task", f"--include_path={checkpoints}/tasks")
  assert unknown.returncode == 1 and unknown.stderr.strip().splitlines()[-1].startswith(
      "evaluate.py: --tasks no_such_task: not among lm-evaluation-harness's tasks or those under"), unknown.stderr[-2000:]
  assert jax.device_count() == 8


def test_perplexity_of_a_split_is_the_models_own_log_likelihood_of_it(checkpoints, tmp_path):
  """tools/evaluate.py --perplexity scores a run's token split in consecutive windows (the eval step's loss); the
  harness class's log-likelihoods of the same windows give the same figure."""
  (tmp_path / "text").mkdir()
  (tmp_path / "text" / "a.txt").write_text(" ".join(WORDS * 40))
  prepare.prepare(tmp_path / "text", tmp_path / "tokens", tokenizer_name=f"hf:{checkpoints / 'gpt2'}",
                  val_fraction=0.5)
  config, layout, params, tokenizer = from_hf(f"hf:{checkpoints / 'gpt2'}", {"data": 8}, "float32")
  config.data.source, config.data.path = "tokens", str(tmp_path / "tokens")
  config.workdir = str(tmp_path / "run")
  checkpoints_dir = Checkpoints(config.workdir, every=0, keep=1)
  checkpoints_dir.save_now(0, state_from_params(layout, params), config)
  checkpoints_dir.close()
  result = subprocess.run([sys.executable, "tools/evaluate.py", f"--workdir={config.workdir}", "--perplexity=val",
                           "--compute=float32", f"--output={tmp_path / 'out.json'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  reported = json.loads((tmp_path / "out.json").read_text())
  split = data.open_split(config.data, "val", vocab_size=config.model.vocab_size)
  windows = [np.asarray(split.tokens[i * MAX_LEN:(i + 1) * MAX_LEN + 1]).tolist()
             for i in range(reported["tokens"] // MAX_LEN)]
  _, layout, params, _ = from_hf(f"hf:{checkpoints / 'gpt2'}", {"data": 8}, "float32")  # the saved state took them
  lm = MeshlmLM(layout, params, tokenizer, batch_size=8)
  total = sum(score for score, _ in lm._loglikelihood_tokens([(None, w[:1], w[1:]) for w in windows]))
  assert reported["tokens"] == 8 * MAX_LEN * ((len(split.tokens) - 1) // MAX_LEN // 8) > 0
  np.testing.assert_allclose(reported["perplexity"], np.exp(-total / reported["tokens"]), rtol=1e-5)


def test_perplexity_of_a_masked_split_scores_only_its_completions(checkpoints, tmp_path):
  (tmp_path / "records.jsonl").write_text("".join(
      json.dumps({"prompt": sentence(np.random.default_rng(i), 5), "completion": " " + WORDS[i % len(WORDS)]}) + "\n"
      for i in range(120)))
  prepare.prepare(None, tmp_path / "tokens", tokenizer_name=f"hf:{checkpoints / 'gpt2'}", val_fraction=0.0,
                  dataset=str(tmp_path / "records.jsonl"), completion_field="completion", text_field="prompt")
  config, layout, params, tokenizer = from_hf(f"hf:{checkpoints / 'gpt2'}", {"data": 8}, "float32")
  config.data.source, config.data.path = "tokens", str(tmp_path / "tokens")
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  perplexity, scored = split_perplexity(layout, params, split, make_eval_step(layout), batch_size=8)
  windows = [np.asarray(split.tokens[i * MAX_LEN:(i + 1) * MAX_LEN + 1]) for i in range(8 * (len(split.tokens) // MAX_LEN // 8))]
  masks = [np.asarray(split.mask[i * MAX_LEN + 1:(i + 1) * MAX_LEN + 1]) for i in range(len(windows))]
  log_probs, _ = MeshlmLM(layout, params, tokenizer).score_rows([w[:-1].tolist() for w in windows],
                                                                [w[1:].tolist() for w in windows])
  picked = [lp[m == 1] for lp, m in zip(log_probs, masks)]
  assert scored == sum(m.sum() for m in masks) < sum(m.size for m in masks)  # the completions, not every token
  np.testing.assert_allclose(perplexity, np.exp(-np.concatenate(picked).mean()), rtol=1e-5)


def exported_with_tokenizer(folder, ids: int):
  """A tiny GPT-2 of 300 vocabulary rows written as a Hugging Face directory (no transformers needed), with a
  byte-level BPE of `ids` ids beside it."""
  layout = plan(tiny_config(**{"model.vocab_size": 300}), jax.devices()[:1])
  params = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), layout.abstract_state["params"])
  hf_checkpoint.write(str(folder), layout.model, params)
  bpe = byte_level_bpe([" ".join(WORDS)] * 20, 270)
  bpe.add_tokens([f"<extra_{i}>" for i in range(ids - bpe.get_vocab_size())])
  assert bpe.get_vocab_size() == ids
  bpe.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT}))
  return folder


def test_an_import_whose_tokenizer_has_ids_past_its_vocabulary_is_refused(tmp_path):
  folder = exported_with_tokenizer(tmp_path / "model", ids=400)
  with pytest.raises(ValueError, match=rf"^hf:{folder}'s tokenizer has 400 ids, more than the model's vocabulary "
                                       r"of 300 \(config.json's vocab_size\), and the ids past 299 would be scored "
                                       r"as garbage; save the tokenizer the model was trained with beside it\.$"):
    from_hf(f"hf:{folder}")


def evaluate_main(*argv) -> str:
  """What tools/evaluate.py, run in this process with `argv`, exits with."""
  flags.FLAGS(["evaluate.py", *argv])
  try:
    with pytest.raises(SystemExit) as stopped:
      evaluate_tool.main(["evaluate.py"])
  finally:
    flags.FLAGS.unparse_flags()
  return stopped.value.code


def test_evaluate_py_refuses_a_task_without_its_data_and_an_empty_batch_in_one_line(tmp_path, monkeypatch):
  # Only the local tasks indexed: the harness's own thousands take 15 s, and none is asked for.
  monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                     include_defaults=False))
  model = f"--init_from=hf:{exported_with_tokenizer(tmp_path / 'model', ids=290)}"
  (tmp_path / "tasks").mkdir()
  write_tasks(tmp_path / "tasks")
  (tmp_path / "tasks" / "choice.jsonl").unlink()
  tasks = ["--tasks=meshlm_choice", f"--include_path={tmp_path / 'tasks'}"]
  assert evaluate_main(model, *tasks, "--batch_size=0") == (
      "evaluate.py: --batch_size=0 scores nothing; give 1 or more requests (or --perplexity windows) per forward "
      "pass.")
  assert evaluate_main(model, *tasks) == (
      f"evaluate.py: the data of --tasks meshlm_choice cannot be found (Unable to find "
      f"'{tmp_path / 'tasks' / 'choice.jsonl'}'); put it where the task's YAML says (dataset_path, dataset_kwargs) "
      "or correct the YAML.")
