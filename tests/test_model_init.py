"""Initialisation: the vocabulary's padding starts (and so stays) zero, in every family; every field of
config.model reaches the model's description; and the parameters drawn on a mesh are those drawn on one device."""

import importlib

import jax
import numpy as np
import pytest

from configs.gpt2 import get_config
from helpers import fresh_state, tiny_config
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


@pytest.mark.parametrize("overrides", [
    {"mesh.data": 4, "mesh.tensor": 2},
    {"mesh.data": 8, "sharding.zero": 3},
    {"mesh.pipeline": 2, "mesh.data": 4, "model.num_layers": 4, "pipeline.schedule": "interleaved",
     "pipeline.virtual_stages": 2},
    {"model.family": "llama", "model.kv_heads": 2, "moe.experts": 4, "mesh.expert": 4, "mesh.data": 2}],
    ids=["data x tensor", "zero-3", "interleaved pipeline", "llama moe over expert"])
def test_parameters_drawn_on_a_mesh_are_those_drawn_on_one_device(overrides):
  # helpers.fresh_state draws the tests' parameters once on one device and moves them onto each layout: that
  # holds only while the draw is blind to the shardings it is compiled for.
  config = tiny_config(**overrides)
  layout = plan(config)
  drawn_on_mesh = jax.device_get(init_state(layout, config.seed))
  moved = jax.device_get(fresh_state(layout, config.seed))
  assert jax.tree.structure(drawn_on_mesh) == jax.tree.structure(moved)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(drawn_on_mesh), jax.tree.leaves(moved)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
