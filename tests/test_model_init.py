"""Initialisation: the vocabulary's padding starts (and so stays) zero, in every family."""

import importlib

import jax
import numpy as np
import pytest

from training.state import init_state, plan


@pytest.mark.parametrize("family,tables", [("gpt2", [("embed", "tokens", 0)]),
                                           ("llama", [("embed", 0), ("head", 1)])])
def test_vocab_padding_is_zero_and_the_real_rows_are_not(family, tables):
  config = importlib.import_module(f"configs.{family}").get_config("tiny")
  config.model.vocab_size = 250  # padded to 256: six padding rows
  layout = plan(config, jax.devices()[:1])
  params = jax.device_get(init_state(layout, seed=0)["params"])
  for *path, vocab_axis in tables:
    table = params
    for key in path:
      table = table[key]
    table = np.moveaxis(np.asarray(table), vocab_axis, 0)
    assert table.shape[0] == 256
    assert not table[250:].any(), path
    assert (np.abs(table[:250]).max(axis=1) > 0).all(), path
