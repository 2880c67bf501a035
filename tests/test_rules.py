"""Logical names resolve to mesh axes, weights and activations apart, each mesh axis once per spec."""

import pytest
from jax.sharding import PartitionSpec as P

from helpers import tiny_config
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
  assert rules.spec(("batch", "length", "embed"), rules.ACTIVATION_RULES) == P(("expert", "data"), "sequence", None)


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
    ({"model.num_layers": 3}, {"pipeline": 2}, "model.num_layers=3 does not split into mesh.pipeline=2"),
    ({"model.num_layers": 4, "pipeline.schedule": "interleaved", "pipeline.virtual_stages": 2},
     {"pipeline": 4}, "mesh.pipeline=4 x pipeline.virtual_stages=2 = 8 equal chunks"),
    ({"pipeline.microbatches": 3}, {"pipeline": 2}, "pipeline.microbatches=3 does not divide"),
    ({"pipeline.schedule": "1f1b", "pipeline.microbatches": 2, "model.num_layers": 4}, {"pipeline": 4},
     "1f1b needs at least as many micro-batches as stages"),
    ({"pipeline.schedule": "zigzag"}, {"pipeline": 2}, "pipeline.schedule='zigzag' is unknown"),
    ({"model.num_layers": 5, "pipeline.first_stage_layers": 1}, {"pipeline": 2},
     "pipeline.first_stage_layers=1 and pipeline.last_stage_layers=0 must both be set"),
    ({"model.num_layers": 5, "pipeline.first_stage_layers": 2, "pipeline.last_stage_layers": 2}, {"pipeline": 2},
     "must be model.num_layers=5 with two chunks; use last_stage_layers=3"),
    ({"model.num_layers": 9, "pipeline.first_stage_layers": 2, "pipeline.last_stage_layers": 2}, {"pipeline": 4},
     "the 5 layers between .* do not split equally over the 2 middle chunks"),
    ({"model.num_layers": 4, "moe.experts": 4, "moe.every": 2, "pipeline.first_stage_layers": 1,
      "pipeline.last_stage_layers": 3}, {"pipeline": 2}, "must be multiples of 2, the layers a scanned unit holds"),
    ({"model.num_layers": 3, "pipeline.first_stage_layers": 1, "pipeline.last_stage_layers": 2,
      "model.embed_dim": 63, "model.num_heads": 3}, {"pipeline": 2},
     r"model.embed_dim=63 is not divisible by the stage weights' split \(mesh.pipeline\)=2"),
    ({"model.num_layers": 3, "pipeline.first_stage_layers": 1, "pipeline.last_stage_layers": 2,
      "attention.context": "ring"}, {"pipeline": 2, "sequence": 2}, "attention.context=ring passes blocks"),
    ({"pipeline.microbatches": 2, "model.num_layers": 4}, {"pipeline": 4, "data": 8},
     "gpipe runs the head on 1/4 of each data-parallel shard's rows, but the shard's 2 sequences"),
])
def test_model_that_does_not_divide_is_refused(overrides, shape, says):
  config = tiny_config(**overrides)
  full = {"data": 1, "pipeline": 1, "expert": 1, "sequence": 1, "tensor": 1, **shape}
  with pytest.raises(ValueError, match=says):
    check_divides(model_config(config), full, batch_size=config.batch_size,
                  grad_accum=config.grad_accum, zero=config.sharding.zero, pipeline=config.pipeline,
                  context=config.attention.context)
