"""Initialisation: the vocabulary's padding starts (and so stays) zero, in every family; and every field of
config.model reaches the model's description."""

import importlib

import jax
import numpy as np
import pytest

from configs.gpt2 import get_config
from training.state import init_state, model_config, plan


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


def test_every_field_of_config_model_reaches_the_model():
  # A field set in config.model and dropped on the way to ModelConfig would train the default silently.
  config = get_config("tiny")
  flipped = {key: not value for key, value in config.model.items() if isinstance(value, bool)}
  assert flipped, "config.model has no switch to flip"
  config.model.update(flipped)
  cfg = model_config(config)
  assert {key: getattr(cfg, key) for key in config.model} == config.model.to_dict()
