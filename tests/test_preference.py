"""Preference objectives (objective=dpo, training/preference.py) against TRL, across meshes, and in train.py.

Two random GPT-2 models are built by transformers in the sidecar (tests/hf_reference.py): the policy and a
reference unlike it, so that the rewards are far from 0. The pairs are random ids written as a prepared folder
and read back through meshlm's batches; TRL's DPOTrainer (and CPOTrainer's SimPO loss) scores the same rows.
Float32 on both sides: the loss and rewards agree to 1e-5 and each weight's gradient to 1e-5 of its largest entry.
"""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs.load import set_fields
from helpers import (ROOT, assert_hf_gradients_close, data_config, hf_gradients, pair_chunks, read_metrics,
                     run_reference, tiny_config)
from input_pipeline import data, token_files
from interop import hf_checkpoint
from model.placement import placed
from parallel import placement
from training import preference
from training.state import plan
from training.step import loss_and_grads

VOCAB, BATCH = 300, 8
GPT2 = dict(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, n_inner=128)
# Each loss with the settings it is checked at: beta 0.5 keeps the sigmoid's slope far from flat.
LOSSES = {"sigmoid": {"dpo.beta": 0.5}, "robust": {"dpo.beta": 0.5, "dpo.label_smoothing": 0.2},
          "ipo": {"dpo.beta": 0.5}, "simpo": {"dpo.beta": 2.0, "dpo.gamma": 0.3},
          # DPO with the chosen answers' log-likelihood beside it (TRL's loss_type=["sigmoid", "sft"])
          "sigmoid+sft": {"dpo.beta": 0.5, "dpo.sft_weight": 0.7}}
FOUR = {"mesh.data": 2, "mesh.tensor": 2}


def trl_examples(rows: dict) -> list:
  """The rows data.pair_rows gives, as TRL's collator takes them: prompt, chosen and rejected ids."""
  examples = []
  for b in range(len(rows["chosen"][0])):
    example = {}
    for answer in data.ANSWERS:
      tokens_W, mask_W = (part[b] for part in rows[answer])
      start = int(np.argmax(mask_W))
      example["prompt_ids"] = tokens_W[:start].tolist()
      example[f"{answer}_ids"] = tokens_W[mask_W == 1].tolist()
    examples.append(example)
  return examples


@pytest.fixture(scope="module")
def trl(tmp_path_factory):
  """A folder with the policy, the reference, the pairs and TRL's figures for each loss (trl_<loss>.npz)."""
  where = tmp_path_factory.mktemp("preference")
  token_files.write_token_folder(where / "pairs", pair_chunks(0, 40, vocab=VOCAB), tokenizer="test", vocab_size=VOCAB,
                                 val_fraction=0.1, masked=True, pairs=True)
  split = data.open_split(data_config(path=where / "pairs"), "train", vocab_size=VOCAB)
  examples = trl_examples(data.pair_rows(split, seed=0, step=0, batch_size=BATCH, seq_len=GPT2["n_positions"]))
  jobs = [{"make": "gpt2", "dir": str(where / name), "config": GPT2, "seed": seed, "save": {}}
          for name, seed in (("policy", 0), ("reference", 1))]
  jobs += [{"dpo": str(where / "policy"), "reference": str(where / "reference"), "examples": examples,
            "loss_type": loss.split("+")[0], "beta": settings["dpo.beta"],
            "label_smoothing": settings.get("dpo.label_smoothing", 0.0), "gamma": settings.get("dpo.gamma", 0.0),
            "sft_weight": settings.get("dpo.sft_weight", 0.0), "out": str(where / f"trl_{loss}.npz")}
           for loss, settings in LOSSES.items()]
  run_reference(jobs, where)
  return where


def meshlm_step(where, loss, devices, **overrides):
  """(loss, statistics, gradients exported under transformers' names) of the first batch on `devices`."""
  config = tiny_config(init_from=f"hf:{where / 'policy'}", objective="dpo", batch_size=BATCH, **LOSSES[loss],
                       **{"dpo.loss": loss.split("+")[0], "data.source": "tokens", "data.path": str(where / "pairs")}, **overrides)
  policy = hf_checkpoint.open_init_from(config.init_from)
  config = set_fields(config, policy.model_fields(config))
  layout = plan(config, devices)
  params = policy.load_params(layout)
  reference = hf_checkpoint.open_init_from(f"hf:{where / 'reference'}").load_params(layout)
  split = data.open_split(config.data, "train", vocab_size=VOCAB)
  batch = data.global_batch(split, seed=0, step=0, batch_size=BATCH, seq_len=layout.model.max_len,
                            sharding=layout.batch_sharding)

  @jax.jit
  def run(params, reference, batch):
    with placed(placement.for_layout(layout)):
      return loss_and_grads(layout, params, preference.with_reference(layout, reference, batch), config.grad_accum)

  (_, stats), grads = jax.device_get(run(params, reference, batch))
  return float(stats[preference.LOSS]), stats, hf_gradients(where, layout.model, grads)


def assert_matches_trl(where, loss, devices, **overrides):
  expected = np.load(where / f"trl_{loss}.npz")
  value, stats, grads = meshlm_step(where, loss, devices, **overrides)
  np.testing.assert_allclose(value, expected["loss"], rtol=1e-5)
  for ours, theirs in (("dpo_chosen_reward", "rewards/chosen"), ("dpo_rejected_reward", "rewards/rejected"),
                       ("dpo_margin", "rewards/margins"), ("dpo_accuracy", "rewards/accuracies")):
    np.testing.assert_allclose(stats[ours], expected[f"figure:{theirs}"], rtol=1e-5, atol=1e-6, err_msg=ours)
  assert_hf_gradients_close(grads, expected)


@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_equals_trl_on_one_device_and_on_data_by_tensor(trl, loss):
  assert_matches_trl(trl, loss, jax.devices()[:1])
  assert_matches_trl(trl, loss, jax.devices()[:4], **FOUR)


def test_dpo_equals_trl_under_zero3_and_accumulation_and_the_ring(trl):
  assert_matches_trl(trl, "sigmoid", jax.devices()[:4], **{"mesh.data": 4, "sharding.zero": 3, "grad_accum": 2})
  assert_matches_trl(trl, "sigmoid", jax.devices()[:4],
                     **{"mesh.data": 2, "mesh.sequence": 2, "attention.context": "ring"})


def write_style_pairs(path, count=300):
  """Sums whose preferred answer ends in a full stop, the other in a question mark: a preference a tiny model
  learns from random weights, and one that holds on pairs it has not seen."""
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for _ in range(count):
      a, b = rng.integers(0, 50, 2)
      f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": f"{a + b}.", "rejected": f"{a + b}?"}) + "\n")


def test_train_py_learns_preferences_and_resumes_with_its_reference(tmp_path):
  write_style_pairs(tmp_path / "pairs.jsonl")
  prepared = subprocess.run([sys.executable, "tools/prepare.py", "--dataset", str(tmp_path / "pairs.jsonl"),
                             "--text_field", "prompt", "--chosen_field", "chosen", "--rejected_field", "rejected",
                             "--output", str(tmp_path / "pairs")], cwd=ROOT, capture_output=True, text=True)
  assert prepared.returncode == 0, prepared.stderr
  assert "preference pairs" in prepared.stdout
  common = ["--config.objective=dpo", "--config.data.source=tokens", f"--config.data.path={tmp_path / 'pairs'}",
            "--config.batch_size=16", "--config.model.max_len=16", "--config.log_every=5", "--config.eval_every=10",
            "--config.sample_tokens=0", "--config.checkpoint.every=10", "--config.dpo.beta=0.5"]

  def train(workdir, steps):
    result = subprocess.run([sys.executable, "train.py", *common, f"--config.steps={steps}",
                             f"--config.workdir={workdir}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr

  output = train(tmp_path / "whole", 20)
  assert "reward accuracy" in output
  records = read_metrics(tmp_path / "whole")
  # Policy and reference start equal, at log 2; held-out pairs end far below it, every one ranked right.
  assert [r["eval_loss"] for r in records if "eval_loss" in r][-1] < 0.01
  assert [r["dpo_accuracy"] for r in records if "dpo_accuracy" in r][-1] == 1.0
  # Stopped after its checkpoint at step 10, then resumed: the reference comes back with the state.
  train(tmp_path / "halves", 10)
  train(tmp_path / "halves", 20)
  last = lambda workdir: [r for r in read_metrics(workdir) if r.get("step") == 20 and "loss" in r][-1]
  assert last(tmp_path / "halves")["loss"] == last(tmp_path / "whole")["loss"]
  assert last(tmp_path / "halves")["dpo_margin"] == last(tmp_path / "whole")["dpo_margin"]


@pytest.mark.parametrize("overrides, message", [
    ({"objective": "dpo"}, r"objective=dpo trains on preference pairs, which data.source='builtin'"),
    ({"objective": "ppo"}, r"objective='ppo' is unknown"),
    ({"objective": "dpo", "data.source": "tokens", "dpo.loss": "kto"}, r"dpo.loss='kto' is unknown"),
    ({"objective": "dpo", "data.source": "tokens", "dpo.label_smoothing": 0.1},
     r"acts on the robust loss only"),
    ({"objective": "dpo", "data.source": "tokens", "dpo.loss": "robust", "dpo.label_smoothing": 0.5},
     r"dpo.label_smoothing=0.5 must be in \[0, 0.5\)"),
    ({"objective": "dpo", "data.source": "tokens", "dpo.beta": 0.0}, r"dpo.beta=0.0 must be a finite number > 0"),
    ({"objective": "dpo", "data.source": "tokens", "mesh.pipeline": 2}, r"objective=dpo with mesh.pipeline=2"),
])
def test_bad_preference_settings_are_refused_in_one_sentence(overrides, message, tmp_path):
  from training.validate import check_run
  with pytest.raises(ValueError, match=message):
    check_run(tiny_config(workdir=str(tmp_path / "run"), **overrides))


def test_pairs_and_objective_must_agree_before_anything_compiles(tmp_path):
  from run.loop import train
  base = dict(workdir=str(tmp_path / "run"), **{"data.source": "tokens", "model.vocab_size": VOCAB})
  token_files.write_token_folder(tmp_path / "pairs", pair_chunks(0, 10, vocab=256), tokenizer="byte", vocab_size=256,
                                 val_fraction=0.1, masked=True, pairs=True)
  with pytest.raises(ValueError, match=r"holds preference pairs, which objective='lm' does not train on"):
    train(tiny_config(**base, **{"data.path": str(tmp_path / "pairs")}))
  token_files.write_token_folder(tmp_path / "plain", [np.arange(1, 200)], tokenizer="byte", vocab_size=256,
                                 val_fraction=0.1)
  with pytest.raises(ValueError, match=r"objective=dpo trains on preference pairs, which .*plain does not hold"):
    train(tiny_config(**base, objective="dpo", **{"data.path": str(tmp_path / "plain")}))
  assert not (tmp_path / "run").exists()
