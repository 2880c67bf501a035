"""bf16 compute with fp32 master weights: matmuls in bf16, weights and optimizer state in fp32."""

import jax
import numpy as np

from conftest import tiny_config
from training import data
from training.dry_run import abstract_inputs
from training.state import init_state, plan
from training.step import make_train_step


def first_step(compute):
  config = tiny_config(**{"precision.compute": compute, "mesh.data": 4, "mesh.tensor": 2})
  layout = plan(config)
  state = init_state(layout, config.seed)
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = data.global_batch(split, seed=0, step=0, batch_size=config.batch_size,
                            seq_len=config.model.max_len, sharding=layout.batch_sharding)
  step = make_train_step(layout, config)
  hlo = step.lower(*abstract_inputs(layout, config)).as_text()
  state, metrics = step(state, batch)
  return float(metrics["loss"]), state, hlo


def test_bf16_compute_keeps_fp32_masters_and_follows_fp32():
  loss32, _, hlo32 = first_step("float32")
  loss16, state16, hlo16 = first_step("bfloat16")
  assert {x.dtype for x in jax.tree.leaves(state16["params"])} == {np.dtype("float32")}
  assert {x.dtype for x in jax.tree.leaves(state16["opt_state"]) if x.ndim} == {np.dtype("float32")}
  assert "bf16" in hlo16 and "bf16" not in hlo32
  # bf16 keeps 8 bits of mantissa: the first loss agrees to well under 1%.
  np.testing.assert_allclose(loss16, loss32, rtol=5e-3)
