"""Gemma 2 and 3 (model/gemma.py): their local and global layers, caps, scale, query/key norms and two rotary
bases on every attention path and pipeline schedule equal one device's one-block run, in float32, at a length
five windows long. transformers' Gemma 2 and 3 are checked in tests/test_hf_checkpoint.py, decoding in
tests/test_sample.py."""

import jax
import numpy as np
import pytest

from helpers import assert_layout_matches, loss_and_gradients

# Four layers, local and global in turn, a window of 6 in 32 positions; scores over 1/sqrt(16) where the heads
# are 24 wide, caps tight enough to bite at initialisation.
GEMMA2 = {"model.family": "gemma2", "model.num_layers": 4, "model.kv_heads": 2, "model.head_width": 24,
          "model.sliding_window": 6, "model.global_every": 2, "model.attention_scale_width": 16,
          "model.attention_softcap": 0.5, "model.logit_softcap": 1.0}
# Gemma 3's pattern in small: six layers of which only the fourth is global (global_every=4 does not divide
# 6, as Gemma 3 1B's 6 does not divide 26); the local layers rotate by a base of 100, the global one by 10,000
# rescaled linearly.
GEMMA3 = {"model.family": "gemma3", "model.num_layers": 6, "model.kv_heads": 2, "model.head_width": 24,
          "model.sliding_window": 6, "model.global_every": 4, "model.attention_scale_width": 16,
          "model.local_rope_theta": 100.0, "model.rope_type": "linear", "model.rope_factor": 2.0}
LAYOUTS = {
    "flash blocks of 8": {"model.attention_block": 8, "mesh.data": 1},
    "data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2},
    "ring sequence=4 x data=2": {"mesh.sequence": 4, "mesh.data": 2, "attention.context": "ring"},
    "ulysses sequence=2 x data=4": {"mesh.sequence": 2, "mesh.data": 4, "attention.context": "ulysses"},
    "1f1b pipeline=2 x data=4": {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "1f1b",
                                 "pipeline.microbatches": 2},
}
# Each stage must know which of the model's layers its slots hold: unequal stages, and interleaved chunks.
GEMMA3_PIPELINES = {
    "gpipe pipeline=2 x data=4, 2 + 4 layers": {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.microbatches": 2,
                                                "pipeline.first_stage_layers": 2, "pipeline.last_stage_layers": 4},
    "ring under gpipe, pipeline=2 x sequence=2 x data=2": {
        "mesh.pipeline": 2, "mesh.sequence": 2, "mesh.data": 2, "attention.context": "ring", "pipeline.microbatches": 2},
    "interleaved pipeline=2 x V=3 x data=4": {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.microbatches": 2,
                                              "pipeline.schedule": "interleaved", "pipeline.virtual_stages": 3},
}


@pytest.fixture(scope="module")
def gemma2_one_device():
  return loss_and_gradients({**GEMMA2, "mesh.data": 1}, jax.devices()[:1])


@pytest.fixture(scope="module")
def gemma3_one_device():
  return loss_and_gradients({**GEMMA3, "mesh.data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("name", LAYOUTS)
def test_gemma2_on_every_path_matches_one_device(name, gemma2_one_device):
  assert_layout_matches({**GEMMA2, **LAYOUTS[name]}, gemma2_one_device, name)


@pytest.mark.parametrize("name", [*LAYOUTS, *GEMMA3_PIPELINES])
def test_gemma3_on_every_path_matches_one_device(name, gemma3_one_device):
  assert_layout_matches({**GEMMA3, **LAYOUTS.get(name, GEMMA3_PIPELINES.get(name))}, gemma3_one_device, name)


def test_only_the_global_layers_see_past_the_window(gemma3_one_device):
  # Every layer made local: the global layer's queries' gradients change, and only that layer's attention
  # differs in its forward pass, so the first three layers' query gradients change less.
  _, local = loss_and_gradients({**GEMMA3, "model.global_every": 0, "model.local_rope_theta": 0.0,
                                 "model.rope_theta": 100.0, "model.rope_type": "default", "mesh.data": 1},
                                jax.devices()[:1])
  ours, theirs = (np.asarray(g["blocks"]["attn"]["q_kernel"]) for g in (gemma3_one_device[1], local))
  change = np.abs(ours - theirs).max(axis=(1, 2, 3)) / np.abs(ours).max()
  assert change[3] > 0.01, change


def test_the_local_layers_rotate_by_their_own_base(gemma3_one_device):
  # The same model with one rotary base everywhere: every layer's gradients move.
  _, alike = loss_and_gradients({**GEMMA3, "model.local_rope_theta": 0.0, "mesh.data": 1}, jax.devices()[:1])
  ours, theirs = (np.asarray(g["blocks"]["attn"]["k_kernel"]) for g in (gemma3_one_device[1], alike))
  assert np.abs(ours - theirs).max() > 0.01 * np.abs(ours).max()
