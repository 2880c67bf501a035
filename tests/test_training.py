"""Training learns, and accumulating micro-batches is the same step as one big batch."""

import math

import jax
import numpy as np

from conftest import tiny_config
from training import data
from training.loop import train
from training.state import init_state, plan
from training.step import make_train_step


def test_loss_falls_far_below_uniform(tmp_path):
  config = tiny_config(**{"steps": 200, "model.max_len": 64, "schedule.warmup_steps": 20,
                          "log_every": 50, "eval_every": 200, "sample_tokens": 0,
                          "workdir": str(tmp_path)})
  last = train(config)
  # Uniform guessing over bytes costs ln(256) = 5.55 nats.
  assert last["loss"] < 0.55 * math.log(256), last
  assert last["eval_loss"] < 0.6 * math.log(256), last
  logged = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(logged) == 5  # four log steps and one eval


def one_step(grad_accum, batch_size, batch_rows):
  config = tiny_config(**{"grad_accum": grad_accum, "batch_size": batch_size, "mesh.data": 4,
                          "mesh.tensor": 2})
  layout = plan(config)
  state = init_state(layout, config.seed)
  batch = {"inputs": jax.device_put(batch_rows[:, :-1], layout.batch_sharding),
           "targets": jax.device_put(batch_rows[:, 1:], layout.batch_sharding)}
  state, metrics = make_train_step(layout, config)(state, batch)
  return jax.device_get((metrics, state["params"]))


def test_grad_accumulation_equals_the_big_batch():
  config = tiny_config()
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  rows = data.batch_rows(split, seed=0, step=0, batch_size=32, seq_len=config.model.max_len)
  big_metrics, big_params = one_step(1, 32, rows)
  acc_metrics, acc_params = one_step(4, 32, rows)
  np.testing.assert_allclose(acc_metrics["loss"], big_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(acc_metrics["grad_norm"], big_metrics["grad_norm"], rtol=1e-5)
  for acc, big in zip(jax.tree.leaves(acc_params), jax.tree.leaves(big_params)):
    np.testing.assert_allclose(acc, big, rtol=1e-5, atol=1e-7)
