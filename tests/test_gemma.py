"""Gemma 2 (model/gemma.py): its local and global layers, caps and scale on every attention path and a pipeline
equal one device's one-block run, in float32, at a length five windows long. transformers' Gemma 2 is checked
in tests/test_hf_checkpoint.py, decoding in tests/test_sample.py."""

import jax
import numpy as np
import pytest

from helpers import assert_layout_matches, loss_and_gradients

# Four layers in local-global pairs, a window of 6 in 32 positions; scores over 1/sqrt(16) where the heads are
# 24 wide, caps tight enough to bite at initialisation.
GEMMA2 = {"model.family": "gemma2", "model.num_layers": 4, "model.kv_heads": 2, "model.head_width": 24,
          "model.sliding_window": 6, "model.global_every": 2, "model.attention_scale_width": 16,
          "model.attention_softcap": 0.5, "model.logit_softcap": 1.0}
LAYOUTS = {
    "flash blocks of 8": {"model.attention_block": 8, "mesh.data": 1},
    "data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2},
    "ring sequence=4 x data=2": {"mesh.sequence": 4, "mesh.data": 2, "attention.context": "ring"},
    "ulysses sequence=2 x data=4": {"mesh.sequence": 2, "mesh.data": 4, "attention.context": "ulysses"},
    # A pair of layers is one scanned unit: two stages of one unit each.
    "1f1b pipeline=2 x data=4": {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "1f1b",
                                 "pipeline.microbatches": 2},
}


@pytest.fixture(scope="module")
def one_device():
  return loss_and_gradients({**GEMMA2, "mesh.data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("name", LAYOUTS)
def test_gemma2_on_every_path_matches_one_device(name, one_device):
  assert_layout_matches({**GEMMA2, **LAYOUTS[name]}, one_device, name)


def test_the_pairs_are_scanned_as_units_of_a_local_and_a_global_layer(one_device):
  pairs = one_device[1]["blocks"]["layers"]
  assert sorted(pairs) == [0, 1] and pairs[0]["attn"]["q_kernel"].shape[0] == 2  # 2 units of 2 layers
  # Layers 1 and 3 see past the window: made local like the others, their queries' gradients change.
  _, local = loss_and_gradients({**GEMMA2, "model.global_every": 0, "mesh.data": 1}, jax.devices()[:1])
  global_q, local_q = np.asarray(pairs[1]["attn"]["q_kernel"]), np.asarray(local["blocks"]["attn"]["q_kernel"])[1::2]
  assert np.abs(global_q - local_q).max() > 0.01 * np.abs(global_q).max()
