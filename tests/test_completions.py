"""Fine-tuning on completions: tools/prepare.py --completion_field marks the answer's tokens, the batches
carry them as per-token loss weights, and the loss is the mean over those tokens alone, on every layout."""

import json

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx

from helpers import assert_tree_close, data_config, objective_and_gradients, read_metrics, setup, tiny_config
from input_pipeline import data, prepare, token_files, tokenizer
from model.placement import placed
from model.transformer import token_losses
from parallel import placement
from run.loop import train
from training.step import normalized_weights

RECORDS = [{"prompt": f"{a} + {b} = ", "completion": str(a + b)} for a in range(30) for b in range(30)]


def write_records(path, records=RECORDS):
  path.write_text("".join(json.dumps(record) + "\n" for record in records))
  return path


def test_prepare_marks_the_completion_and_its_end_of_text_and_nothing_else(tmp_path):
  records = [{"prompt": "Q: two? A: ", "completion": "2"}, {"prompt": "", "completion": "empty prompt"},
             {"prompt": "no answer", "completion": ""}] * 10
  prepare.prepare(None, tmp_path / "out", dataset=str(write_records(tmp_path / "r.jsonl", records)),
                  text_field="prompt", completion_field="completion", val_fraction=0.2)
  byte = tokenizer.load_tokenizer("byte")
  ids, mask = [], []
  for record in records:
    prompt, completion = byte.encode(record["prompt"]), np.append(byte.encode(record["completion"]), byte.end_of_text)
    ids += [*prompt, *completion]
    mask += [0] * len(prompt) + [1] * len(completion)
  splits = [data.open_split(data_config(path=tmp_path / "out"), name, vocab_size=256) for name in ("train", "val")]
  assert len(splits[1].tokens) == round(0.2 * len(ids)) > 0
  np.testing.assert_array_equal(np.concatenate([s.tokens for s in splits]), ids)
  np.testing.assert_array_equal(np.concatenate([s.mask for s in splits]), mask)
  # Prepared again without completions, the folder's masks go with the data they belonged to.
  prepare.prepare(None, tmp_path / "out", dataset=str(tmp_path / "r.jsonl"), text_field="prompt", overwrite=True)
  assert data.open_split(data_config(path=tmp_path / "out"), "train", vocab_size=256).mask is None
  assert not (tmp_path / "out" / "train.mask").exists()


def test_completions_need_records(tmp_path):
  with pytest.raises(ValueError, match="--completion_field=completion reads records: give them as --dataset"):
    prepare.prepare(tmp_path, tmp_path / "out", completion_field="completion")
  with pytest.raises(ValueError, match="has no field 'answer'; its fields are completion, prompt: pass one as "
                                       "--completion_field"):
    prepare.prepare(None, tmp_path / "out", dataset=str(write_records(tmp_path / "r.jsonl")), text_field="prompt",
                    completion_field="answer")
  # A parquet file gives a cell that a record lacks as null: that record has no completion, not an empty one.
  pq.write_table(pa.Table.from_pylist([{**r, "completion": None if i == 50 else r["completion"]}
                                       for i, r in enumerate(RECORDS[:101])]), tmp_path / "r.parquet")
  with pytest.raises(ValueError, match=r"^record 50 of .*/r\.parquet holds null in 'completion', not text; give that "
                                       r"record its text \(an empty string will do\), or drop it\.$"):
    prepare.prepare(None, tmp_path / "out", dataset=str(tmp_path / "r.parquet"), text_field="prompt",
                    completion_field="completion")
  assert not (tmp_path / "out").exists()


WEIGHTS = (np.random.default_rng(0).random((16, 32)) < 0.3).astype(np.float32)  # the tiny config's batch


def weighted_run(overrides, devices, weights=WEIGHTS):
  """(loss, gradients) of the first batch with per-token loss weights, traced as the train step traces them."""
  config, layout, state, batch = setup({"model.num_layers": 2, **overrides}, devices)
  batch = {**batch, "weights": jax.device_put(weights, layout.batch_sharding)}
  (loss, _), grads = jax.device_get(objective_and_gradients(layout, config.grad_accum)(state["params"], batch))
  return loss, grads, (layout, state["params"], batch)


@pytest.fixture(scope="module")
def one_device():
  return weighted_run({"mesh.data": 1}, jax.devices()[:1])


def test_the_loss_is_the_mean_over_the_weighted_tokens_alone(one_device):
  loss, _, (layout, params, batch) = one_device
  with placed(placement.for_layout(layout)):
    logits = jax.jit(lambda p, t: nnx.merge(layout.graphdef, p).predict(t))(params, batch["inputs"])
  losses = np.asarray(token_losses(logits, batch["targets"]))
  expected = losses[WEIGHTS == 1].mean()
  assert abs(loss - expected) < 1e-6 * expected, (loss, expected)
  assert abs(losses.mean() - expected) > 1e-3  # the unweighted mean is another number
  # Normalised over the whole batch before any split, so that every part's mean adds up to this one.
  assert np.asarray(normalized_weights({"weights": WEIGHTS})["weights"]).mean() == pytest.approx(1.0)


# Data x tensor with accumulated micro-batches, both pipeline schedule families, and the ring's zig-zag
# order: each splits or reorders the weights with the tokens.
LAYOUTS = {
    "data=4 x tensor=2, grad_accum=2": {"mesh.data": 4, "mesh.tensor": 2, "grad_accum": 2},
    "pipeline=2 x data=4, 1f1b": {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "1f1b",
                                  "pipeline.microbatches": 2},
    "pipeline=2 x data=4, gpipe": {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.microbatches": 2},
    "sequence=2 ring x data=4": {"mesh.sequence": 2, "mesh.data": 4, "attention.context": "ring"},
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_weighted_loss_and_gradients_match_one_device(name, one_device):
  loss, grads, _ = weighted_run(LAYOUTS[name], jax.devices())
  assert abs(loss - one_device[0]) < 1e-5 * one_device[0], (loss, one_device[0])
  assert_tree_close(grads, one_device[1], f"gradient on {name}")


def test_a_run_on_completions_learns_the_answers(tmp_path):
  """The walk in docs/huggingface.md, shortened: prepare the records, train on their completions."""
  prepare.prepare(None, tmp_path / "sums", dataset=str(write_records(tmp_path / "sums.jsonl")), text_field="prompt",
                  completion_field="completion")
  config = tiny_config(**{"data.source": "tokens", "data.path": str(tmp_path / "sums"), "data.segments": True,
                          "steps": 60, "log_every": 10, "eval_every": 60, "schedule.warmup_steps": 6,
                          "optimizer.lr": 1e-2, "sample_tokens": 0, "workdir": str(tmp_path / "run")})
  train(config)
  losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
  # The answers are 1 to 3 digits and a newline, scored alone: the loss over them falls by a third in 50
  # steps (2.18 at step 10, 1.42 at step 60 here).
  assert losses[-1] < 0.7 * losses[0], losses
  evaluated = [r["eval_loss"] for r in read_metrics(tmp_path / "run") if "eval_loss" in r]
  assert len(evaluated) == 1 and evaluated[0] < 2, evaluated  # the val split's answers, scored the same way


def test_a_split_that_scores_no_token_is_refused_before_compiling(tmp_path, monkeypatch):
  prepare.prepare(None, tmp_path / "sums", dataset=str(write_records(tmp_path / "sums.jsonl")), text_field="prompt",
                  completion_field="completion", val_fraction=0.1)
  config = tiny_config(**{"data.source": "tokens", "data.path": str(tmp_path / "sums"), "sample_tokens": 0,
                          "steps": 2, "workdir": str(tmp_path / "run")})
  masks = {split: tmp_path / "sums" / f"{split}.mask" for split in ("train", "val")}
  scored = {split: np.fromfile(path, np.uint8) for split, path in masks.items()}
  # Read a chunk at a time up to the first that scores a token: one scored at the very end is found.
  monkeypatch.setattr(token_files, "SCAN_TOKENS", 1000)
  for split, path in masks.items():
    np.zeros_like(scored[split]).tofile(path)
    with pytest.raises(ValueError, match=rf"^{path} scores none of its {len(scored[split]):,} tokens \(every flag "
                                         r"is 0\): the loss would be 0 at every step and teach nothing; prepare the "
                                         r"folder again from records whose answers are scored \(tools/prepare\.py "
                                         r"--completion_field or --messages_field\)\.$"):
      train(config)
    assert not (tmp_path / "run").exists()
    last_only = np.zeros_like(scored[split])
    last_only[-1] = 1
    last_only.tofile(path)
    assert data.open_split(data_config(path=tmp_path / "sums"), split, vocab_size=256).mask[-1] == 1
    scored[split].tofile(path)
