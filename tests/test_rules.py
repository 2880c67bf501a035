"""Logical names resolve to mesh axes, weights and activations apart, each mesh axis once per spec."""

import pytest
from jax.sharding import PartitionSpec as P

from conftest import tiny_config
from parallel import rules
from parallel.checks import check_divides
from training.state import model_config


def test_megatron_layout_falls_out_of_the_rules():
  table = rules.weight_rules(zero=0)
  assert rules.spec(("layers", "embed", "mlp"), table) == P("pipeline", None, "tensor")
  assert rules.spec(("layers", "mlp", "embed"), table) == P("pipeline", "tensor", None)
  assert rules.spec(("vocab", "embed"), table) == P("tensor", None)


def test_fsdp_shards_embed_over_data_and_activations_keep_batch_there():
  assert rules.spec(("layers", "embed", "mlp"), rules.weight_rules(zero=3)) == P("pipeline", "data", "tensor")
  assert rules.spec(("batch", "length", "embed"), rules.ACTIVATION_RULES) == P(("data", "expert"), "sequence", None)


def test_zero1_puts_only_the_optimizer_state_over_data():
  assert rules.spec(("embed", "mlp"), rules.weight_rules(zero=1)) == P(None, "tensor")
  assert rules.spec(("embed", "mlp"), rules.optimizer_rules(zero=1)) == P("data", "tensor")


def test_a_mesh_axis_is_used_once_per_spec():
  assert rules.spec(("mlp", "heads"), rules.ACTIVATION_RULES) == P("tensor", None)


def test_unknown_logical_axis_is_named():
  with pytest.raises(KeyError, match="'widht'"):
    rules.spec(("widht",), rules.ACTIVATION_RULES)


@pytest.mark.parametrize("overrides, shape, says", [
    ({"model.mlp_dim": 250}, {"tensor": 4}, "model.mlp_dim=250 is not divisible by mesh.tensor=4"),
    ({"sharding.zero": 3, "model.embed_dim": 96, "model.num_heads": 4}, {"data": 64}, "model.embed_dim=96"),
    ({"sharding.zero": 2}, {}, "sharding.zero=2"),
    ({"grad_accum": 3}, {}, "grad_accum=3"),
    ({}, {"pipeline": 2}, "mesh.pipeline=2 needs a pipeline schedule"),
])
def test_model_that_does_not_divide_is_refused(overrides, shape, says):
  config = tiny_config(**overrides)
  full = {"data": 1, "pipeline": 1, "expert": 1, "sequence": 1, "tensor": 1, **shape}
  with pytest.raises(ValueError, match=says):
    check_divides(model_config(config), full, batch_size=config.batch_size,
                  grad_accum=config.grad_accum, zero=config.sharding.zero)
