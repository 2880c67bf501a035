"""GRPO (training/grpo.py, training/rollouts.py, training/rewards.py): the loss, its KL term and its gradient equal
TRL's GRPOTrainer's on one device and on sharded layouts, the advantages TRL's; train.py raises a reward from
its own samples and resumes as if never stopped; bad settings are refused in one sentence."""

import json

import jax
import numpy as np
import pytest

from configs.load import set_fields
from helpers import assert_hf_gradients_close, hf_gradients, read_metrics, run_reference, tiny_config
from interop import hf_checkpoint
from model.placement import placed
from parallel import placement
from run.loop import train
from training import grpo, rewards, rollouts
from training.state import plan
from training.step import loss_and_grads
from training.validate import check_run

VOCAB, BATCH, GROUP, PROMPT, COMPLETION = 300, 8, 4, 5, 6
GPT2 = dict(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, n_inner=128)
# Each loss type with the settings it is checked at: the KL term and a temperature ride on TRL's original loss.
SETTINGS = {"dapo": {"grpo.loss": "dapo"},
            "grpo+kl": {"grpo.loss": "grpo", "grpo.beta": 0.05, "grpo.temperature": 0.7},
            "dr_grpo": {"grpo.loss": "dr_grpo", "grpo.scale_rewards": "batch"},
            "unscaled": {"grpo.loss": "dapo", "grpo.scale_rewards": "none"}}
FOUR = {"mesh.data": 2, "mesh.tensor": 2}


def rollout_arrays() -> dict:
  """A batch of rollouts as TRL holds them: GROUP completions of each prompt, of 1..COMPLETION tokens, rewarded."""
  rng = np.random.default_rng(0)
  prompt_ids = np.repeat(rng.integers(1, VOCAB, (BATCH // GROUP, PROMPT)), GROUP, axis=0)
  lengths = rng.integers(1, COMPLETION + 1, BATCH)
  return {"prompt_ids": prompt_ids, "completion_ids": rng.integers(1, VOCAB, (BATCH, COMPLETION)),
          "completion_mask": (np.arange(COMPLETION) < lengths[:, None]).astype(np.int64),
          "rewards": rng.integers(0, 3, BATCH).astype(np.float32)}


@pytest.fixture(scope="module")
def trl(tmp_path_factory):
  """A folder with the policy, the reference, the rollouts and TRL's figures for each setting (trl_<name>.npz)."""
  where = tmp_path_factory.mktemp("grpo")
  np.savez(where / "batch.npz", **rollout_arrays())
  jobs = [{"make": "gpt2", "dir": str(where / name), "config": GPT2, "seed": seed, "save": {}}
          for name, seed in (("policy", 0), ("reference", 1))]
  jobs += [{"grpo": str(where / "policy"), "reference": str(where / "reference"), "batch": str(where / "batch.npz"),
            "group": GROUP, "loss_type": settings["grpo.loss"], "beta": settings.get("grpo.beta", 0.0),
            "temperature": settings.get("grpo.temperature", 1.0),
            "scale_rewards": settings.get("grpo.scale_rewards", "group"), "out": str(where / f"trl_{name}.npz")}
           for name, settings in SETTINGS.items()]
  run_reference(jobs, where)
  return where


def meshlm_step(where, name, devices, **overrides):
  """(loss, statistics, gradients under transformers' names, advantages) of the rollouts on `devices`."""
  config = tiny_config(init_from=f"hf:{where / 'policy'}", objective="grpo", batch_size=BATCH,
                       **{"grpo.group": GROUP, "grpo.max_new_tokens": COMPLETION}, **SETTINGS[name], **overrides)
  policy = hf_checkpoint.open_init_from(config.init_from)
  config = set_fields(config, policy.model_fields(config))
  layout = plan(config, devices)
  params = policy.load_params(layout)
  reference = hf_checkpoint.open_init_from(f"hf:{where / 'reference'}").load_params(layout)
  arrays = rollout_arrays()
  advantages_B = grpo.advantages(arrays["rewards"], GROUP, config.grpo.scale_rewards)
  entries = rollouts.batch_entries(list(arrays["prompt_ids"]), list(arrays["completion_ids"]),
                                   arrays["completion_mask"].sum(1), advantages_B, layout.model.max_len, layout.grpo)
  batch = {key: jax.device_put(entry, layout.batch_sharding) for key, entry in entries.items()}

  @jax.jit
  def run(params, reference, batch):
    with placed(placement.for_layout(layout)):
      return loss_and_grads(layout, params, grpo.with_reference(layout, reference, batch), config.grad_accum)

  (_, stats), grads = jax.device_get(run(params, reference, batch))
  return float(stats[grpo.LOSS]), stats, hf_gradients(where, layout.model, grads), advantages_B


def assert_matches_trl(where, name, devices, **overrides):
  expected = np.load(where / f"trl_{name}.npz")
  value, stats, grads, advantages_B = meshlm_step(where, name, devices, **overrides)
  np.testing.assert_allclose(advantages_B, expected["advantages"], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(value, expected["loss"], rtol=1e-5, atol=1e-7)
  if "figure:kl" in expected.files:
    assert expected["figure:kl"] > 1e-3  # the reference differs: the KL term has teeth
    if not overrides.get("grad_accum", 1) > 1:  # accumulated, the logged KL is the micro-batches' mean of means
      np.testing.assert_allclose(stats["grpo_kl"], expected["figure:kl"], rtol=1e-5)
  assert_hf_gradients_close(grads, expected)


@pytest.mark.parametrize("name", SETTINGS)
def test_each_loss_equals_trl_on_one_device_and_on_data_by_tensor(trl, name):
  assert_matches_trl(trl, name, jax.devices()[:1])
  assert_matches_trl(trl, name, jax.devices()[:4], **FOUR)


def test_grpo_equals_trl_under_zero3_and_accumulation_and_the_ring(trl):
  assert_matches_trl(trl, "grpo+kl", jax.devices()[:4], **{"mesh.data": 4, "sharding.zero": 3, "grad_accum": 2})
  assert_matches_trl(trl, "dapo", jax.devices()[:4], **{"mesh.data": 2, "mesh.sequence": 2,
                                                        "attention.context": "ring"})


def test_a_reference_is_kept_where_the_kl_term_needs_one_and_lora_has_none_of_its_own():
  held = lambda **overrides: "reference" in plan(tiny_config(objective="grpo", **overrides)).abstract_state
  assert held(**{"grpo.beta": 0.1})
  assert not held()  # beta 0: no KL term
  assert not held(**{"grpo.beta": 0.1, "lora.rank": 4})  # the frozen weights are the reference


def write_sums(path, numbers):
  with open(path, "w") as f:
    for a in numbers:
      for b in range(10):
        f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def test_train_py_raises_a_reward_from_its_own_samples_and_resumes_exactly(tmp_path):
  write_sums(tmp_path / "train.jsonl", range(8))
  write_sums(tmp_path / "held_out.jsonl", range(8, 10))
  # A digit as the one new token: about 4% of a random byte model's samples at first.
  common = {"objective": "grpo", "grpo.prompts": str(tmp_path / "train.jsonl"),
            "grpo.eval_prompts": str(tmp_path / "held_out.jsonl"), "grpo.reward": "format:[0-9]",
            "grpo.max_new_tokens": 1, "grpo.group": 8, "batch_size": 32,
            "optimizer.lr": 3e-2, "log_every": 1, "eval_every": 5, "checkpoint.every": 10, "sample_tokens": 0}
  last = train(tiny_config(**common, steps=20, workdir=str(tmp_path / "whole")))
  records = read_metrics(tmp_path / "whole")
  sampled = [r["grpo_reward"] for r in records if "grpo_reward" in r]
  assert np.mean(sampled[:3]) < 0.2 and np.mean(sampled[-3:]) > 0.8, sampled
  # Greedy answers to held-out prompts: digits by the end, not at first.
  held_out = [r["eval_reward"] for r in records if "eval_reward" in r]
  assert held_out[0] < 0.5 and held_out[-1] == 1.0, held_out
  # Stopped at its checkpoint at step 10, then resumed: the samples are the same functions of (seed, step, weights).
  train(tiny_config(**common, steps=10, workdir=str(tmp_path / "halves")))
  resumed = train(tiny_config(**common, steps=20, workdir=str(tmp_path / "halves")))
  for key in ("loss", "grad_norm", "grpo_reward", "grpo_completion_length", "eval_reward"):
    assert resumed[key] == last[key], key


def test_grpo_trains_adapters_against_the_frozen_weights_on_data_by_tensor(tmp_path):
  write_sums(tmp_path / "train.jsonl", range(8))
  train(tiny_config(**{"objective": "grpo", "grpo.prompts": str(tmp_path / "train.jsonl"), "grpo.beta": 0.1,
                       "grpo.reward": "format:[0-9]", "grpo.max_new_tokens": 2, "lora.rank": 4,
                       "mesh.data": 4, "mesh.tensor": 2, "optimizer.lr": 3e-2, "steps": 3, "log_every": 1,
                       "eval_every": 0, "sample_tokens": 0, "workdir": str(tmp_path / "run")}))
  kl = [r["grpo_kl"] for r in read_metrics(tmp_path / "run") if "grpo_kl" in r]
  # B starts at zero: the first step's policy is its reference; then the adapters move it away.
  assert kl[0] == 0 and kl[-1] > 0, kl


def digit_share(completions, answers):
  """A reward of this module's, named as module:function."""
  return [sum(ch.isdigit() for ch in c.strip()) / max(len(c.strip()), 1) for c in completions]


def test_rewards_score_as_named_and_sum():
  completions, answers = [" 12", "1a", "x"], ["12", "1a", "y"]
  assert rewards.reward("exact_match")(completions, answers) == [1.0, 1.0, 0.0]
  assert rewards.reward("format:[0-9]+")(completions, answers) == [1.0, 0.0, 0.0]
  assert rewards.reward("exact_match,test_grpo:digit_share")(completions, answers) == [2.0, 1.5, 0.0]
  assert rewards.reward("exact_match,format:[0-9]{1,2}")(completions, answers) == [2.0, 1.0, 0.0]


def test_a_completion_ends_at_its_first_stop_token_and_is_weighted_as_its_loss_type_averages():
  tokens_BN = np.array([[5, 7, 0, 9], [5, 6, 7, 8], [10, 5, 5, 5]])
  np.testing.assert_array_equal(rollouts.completion_lengths(tokens_BN, np.array([0, 10])), [3, 4, 1])
  mask_BT = np.array([[0, 1, 1, 0], [1, 1, 1, 1]], np.float32)
  per_token_BT = np.arange(8, dtype=np.float32).reshape(2, 4)
  mean = lambda loss: (per_token_BT * grpo.completion_weights(mask_BT, loss, max_new_tokens=5)).mean()
  np.testing.assert_allclose(mean("dapo"), (1 + 2 + 4 + 5 + 6 + 7) / 6)
  np.testing.assert_allclose(mean("grpo"), ((1 + 2) / 2 + (4 + 5 + 6 + 7) / 4) / 2)
  np.testing.assert_allclose(mean("dr_grpo"), (1 + 2 + 4 + 5 + 6 + 7) / (2 * 5))


GOOD = {"objective": "grpo", "grpo.prompts": "prompts.jsonl", "eval_every": 0}


@pytest.mark.parametrize("overrides, message", [
    ({"grpo.prompts": ""}, r"grpo.prompts names none"),
    ({"grpo.group": 1}, r"grpo.group=1 must be an integer of at least 2"),
    ({"grpo.group": 3}, r"batch_size=16 is not a multiple of grpo.group=3"),
    ({"grpo.loss": "ppo"}, r"grpo.loss='ppo' is unknown"),
    ({"grpo.scale_rewards": "std"}, r"grpo.scale_rewards='std' is unknown"),
    ({"grpo.top_p": 0.0}, r"grpo.top_p=0 keeps no token"),
    ({"grpo.temperature": 0.0}, r"grpo.temperature=0.0 must be a finite number > 0"),
    ({"grpo.reward": "exact"}, r"grpo.reward='exact' is unknown"),
    ({"grpo.reward": "no_such_module:f"}, r"cannot be imported"),
    ({"grpo.reward": "format:("}, r"holds no valid regular expression"),
    ({"eval_every": 10}, r"scores greedy answers to grpo.eval_prompts, which names no file"),
    ({"data.source": "tokens"}, r"reads no token data"),
    ({"mesh.pipeline": 2}, r"objective=grpo with mesh.pipeline=2"),
])
def test_bad_grpo_settings_are_refused_in_one_sentence(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    check_run(tiny_config(workdir=str(tmp_path / "run"), **{**GOOD, **overrides}))


def test_prompts_the_rollouts_cannot_take_are_refused_before_compiling(tmp_path):
  write_sums(tmp_path / "sums.jsonl", range(2))
  common = {**GOOD, "grpo.prompts": str(tmp_path / "sums.jsonl"), "steps": 1, "sample_tokens": 0}
  for overrides, message in (({"grpo.answer_field": "result"}, r"record 1 of .* has no 'result'"),
                             ({"grpo.max_new_tokens": 40}, r"exceeds the model's context of model.max_len=32"),
                             ({"grpo.stop": "ab"}, r"grpo.stop holds 'ab', which is 2 tokens"),
                             ({"grpo.prompts": str(tmp_path / "none.jsonl")}, r"is not a file")):
    with pytest.raises(ValueError, match=message):
      train(tiny_config(workdir=str(tmp_path / "run"), **{**common, **overrides}))
    assert not (tmp_path / "run" / "checkpoints").exists()
