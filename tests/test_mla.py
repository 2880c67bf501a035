"""Multi-head latent attention (model/mla.py) computes on every mesh what it computes on one device, in float32:
split by head over `tensor`, its latents under ZeRO-3, its sequence over `sequence` by every context strategy and
its layers over pipeline stages. transformers' DeepSeek-V3 is checked in tests/test_hf_checkpoint.py, decoding
from the latent cache in tests/test_sample.py."""

import jax
import numpy as np
import pytest

from helpers import assert_layout_matches, loss_and_gradients, tiny_config
from model.kv_cache import init_cache
from training.state import model_config

# Queries through a latent of 12, keys and values from one of 16; heads 24 wide, 8 of them rotary; values 16 wide.
MLA = {"model.family": "llama", "model.num_layers": 4, "model.head_width": 24, "mla.kv_rank": 16, "mla.q_rank": 12,
       "mla.rope_dim": 8, "mla.v_dim": 16}
LAYOUTS = {
    "flash blocks of 8": {"model.attention_block": 8, "mesh.data": 1},
    "data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2},
    "zero-3 data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "sharding.zero": 3},
    "ring sequence=4 x data=2": {"mesh.sequence": 4, "mesh.data": 2, "attention.context": "ring"},
    "ulysses sequence=2 x tensor=2 x data=2": {"mesh.sequence": 2, "mesh.tensor": 2, "mesh.data": 2,
                                               "attention.context": "ulysses"},
    "1f1b pipeline=2 x tensor=2 x data=2": {"mesh.pipeline": 2, "mesh.tensor": 2, "mesh.data": 2,
                                            "pipeline.schedule": "1f1b", "pipeline.microbatches": 2},
    "queries without a latent, data=4 x tensor=2": {"mla.q_rank": 0, "mesh.data": 4, "mesh.tensor": 2},
}


@pytest.fixture(scope="module")
def one_device():
  return loss_and_gradients({**MLA, "mesh.data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("name", LAYOUTS)
def test_latent_attention_on_every_path_matches_one_device(name, one_device):
  overrides = {**MLA, **LAYOUTS[name]}
  reference = one_device if overrides["mla.q_rank"] else loss_and_gradients({**overrides, "mesh.data": 1,
                                                                              "mesh.tensor": 1}, jax.devices()[:1])
  assert_layout_matches(overrides, reference, name)


def test_the_cache_holds_the_latent_and_the_rotary_key_only():
  # 16 + 8 numbers per token and layer, against 2 x 4 heads x 24 for the same heads' keys and values.
  cfg = model_config(tiny_config(**MLA))
  cache = init_cache(cfg, batch=2)
  per_token = sum(np.prod(x.shape[-2:]) for x in cache.values())
  assert per_token == 16 + 8 and cache["k"].shape[-3] == cfg.max_len
  ordinary = init_cache(model_config(tiny_config(**{"model.family": "llama", "model.head_width": 24})), batch=2)
  assert sum(np.prod(x.shape[-2:]) for x in ordinary.values()) == 2 * 4 * 24
