"""Training learns, and accumulating micro-batches is the same step as one big batch."""

import math

import jax
import numpy as np

from helpers import STEPS, assert_params_close, fresh_state, read_metrics, tiny_config
from input_pipeline import data
from run.loop import train
from training.in_flight import StepsInFlight
from training.state import plan
from training.step import make_train_step


def test_loss_falls_far_below_uniform(tmp_path):
  config = tiny_config(**{"steps": 120, "model.max_len": 64, "schedule.warmup_steps": 12,
                          "log_every": 30, "eval_every": 120, "sample_tokens": 0,
                          "workdir": str(tmp_path)})
  last = train(config)
  # Uniform guessing over bytes costs ln(256) = 5.55 nats.
  assert last["loss"] < 0.55 * math.log(256), last
  assert last["eval_loss"] < 0.6 * math.log(256), last
  logged = read_metrics(tmp_path)
  assert len(logged) == 5  # four log steps and one eval


def train_on(grad_accum, batches):
  """The last step's metrics and the params after a step per batch of rows, in `grad_accum` micro-batches."""
  config = tiny_config(**{"grad_accum": grad_accum, "batch_size": len(batches[0]), "mesh.data": 4,
                          "mesh.tensor": 2})
  layout = plan(config)
  state, step = fresh_state(layout, config.seed), make_train_step(layout, config)
  for rows in batches:
    batch = {"inputs": jax.device_put(rows[:, :-1], layout.batch_sharding),
             "targets": jax.device_put(rows[:, 1:], layout.batch_sharding)}
    state, metrics = step(state, batch)
  return jax.device_get((metrics, state["params"]))


def test_grad_accumulation_equals_the_big_batch():
  config = tiny_config()
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  # Several steps, not one: step 0's learning rate is 0 (warmup), and AdamW's first update is about
  # lr x sign(g); the later ones weigh each gradient against the moments of the earlier ones.
  batches = [data.batch_rows(split, seed=0, step=i, batch_size=32, seq_len=config.model.max_len)
             for i in range(STEPS)]
  big_metrics, big_params = train_on(1, batches)
  acc_metrics, acc_params = train_on(4, batches)
  np.testing.assert_allclose(acc_metrics["loss"], big_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(acc_metrics["grad_norm"], big_metrics["grad_norm"], rtol=1e-5)
  assert_params_close(acc_params, big_params, f"parameter after {STEPS} steps")


def test_steps_in_flight_waits_for_the_oldest_beyond_the_limit():
  waited = []

  class Output:
    def __init__(self, step):
      self.step = step

    def block_until_ready(self):
      waited.append(self.step)

  in_flight = StepsInFlight(limit=2)
  for step in range(5):
    in_flight.add(Output(step))
  assert waited == [0, 1, 2]  # steps 3 and 4 may still run
