"""Context parallelism: every strategy over `sequence`, both families, equals the unsharded run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_tree_close, compiled_forward, loss_and_gradients, tiny_config
from measure import analysis
from parallel import context
from parallel.checks import check_divides
from parallel.context import zigzag_order
from parallel.mesh import make_mesh
from training.state import model_config, plan

FAMILIES = {
    "gpt2": {"model.num_heads": 8},
    "llama": {"model.family": "llama", "model.num_heads": 8, "model.kv_heads": 4, "model.mlp_dim": 192},
}
# GPT-2 over every degree and strategy (Ulysses needs heads divisible by the degree: 8 heads,
# 4 key/value heads for llama); the Llama family once per strategy.
CASES = [("gpt2", shards, strategy) for shards in (2, 4, 8) for strategy in ("allgather", "ring", "ulysses")
         if not (strategy == "ulysses" and shards == 8)]
CASES += [("llama", 8, "ring"), ("llama", 4, "ulysses"), ("llama", 2, "allgather")]


@pytest.fixture(scope="module")
def references():
  return {family: loss_and_gradients({**overrides, "mesh.data": 1}, jax.devices()[:1])
          for family, overrides in FAMILIES.items()}


@pytest.mark.parametrize("family, shards, strategy", CASES, ids=[f"{f} sequence={s} {c}" for f, s, c in CASES])
def test_strategy_matches_unsharded(family, shards, strategy, references):
  loss, grads = loss_and_gradients({**FAMILIES[family], "mesh.sequence": shards, "mesh.data": 8 // shards,
                                    "attention.context": strategy}, jax.devices())
  np.testing.assert_allclose(loss, references[family][0], rtol=1e-5)
  assert_tree_close(grads, references[family][1], "gradient")


@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_strategies_compose_with_tensor_and_data(strategy, references):
  loss, grads = loss_and_gradients({**FAMILIES["gpt2"], "mesh.sequence": 2, "mesh.tensor": 2, "mesh.data": 2,
                                    "attention.context": strategy}, jax.devices())
  np.testing.assert_allclose(loss, references["gpt2"][0], rtol=1e-5)
  assert_tree_close(grads, references["gpt2"][1], "gradient")


def test_zigzag_order_balances_causal_work():
  length, shards = 64, 4
  order = zigzag_order(length, shards)
  assert sorted(order) == list(range(length))
  # A query at position p attends to p + 1 keys; each shard's queries must add up to the same work.
  work = [(order[i * length // shards:(i + 1) * length // shards] + 1).sum() for i in range(shards)]
  assert len(set(work)) == 1, work


def forward_collectives(strategy, **overrides):
  config = tiny_config(**{**FAMILIES["llama"], "mesh.sequence": 4, "mesh.data": 2,
                          "attention.context": strategy, **overrides})
  layout = plan(config)
  return analysis.collectives(compiled_forward(layout, config), layout.mesh)


def test_ring_permutes_keys_and_values_and_gathers_nothing():
  found = forward_collectives("ring")
  # Per layer (2), keys, values and their positions each take S - 1 = 3 hops, in a loop over the
  # hops; the only gathers are of token ids for the zig-zag order, outside the layer loop.
  permutes = [c for c in found if c.kind == "collective-permute" and c.axes == ("sequence",)]
  assert sorted(c.trips for c in permutes) == [2 * 3] * 3, analysis.summary_table(found)
  assert analysis.count_by(found, kind="all-gather", in_loop=True) == 0, analysis.summary_table(found)


def test_allgather_gathers_keys_and_values_once_per_layer():
  found = forward_collectives("allgather")
  assert analysis.count_by(found, kind="all-gather", axes="sequence", in_loop=True) == 2, (
      analysis.summary_table(found))


def test_ulysses_trades_sequence_for_heads_with_all_to_alls():
  found = forward_collectives("ulysses")
  # q, k and v in, the output back: four all-to-alls per layer.
  assert analysis.count_by(found, kind="all-to-all", axes="sequence", in_loop=True) == 4, (
      analysis.summary_table(found))


@pytest.mark.parametrize("overrides, sequence, says", [
    ({"model.max_len": 36}, 8, "model.max_len=36 is not divisible by mesh.sequence=8"),
    ({"attention.context": "ring", "model.max_len": 20}, 4, "2 x mesh.sequence"),
    ({"attention.context": "ulysses", "model.num_heads": 4}, 8, "Ulysses splits heads"),
    ({"model.attention": "cudnn"}, 2, "model.attention='cudnn' masks by index"),
    ({"model.attention": "splash", "model.max_len": 128}, 2, "model.attention='splash' masks by index"),
    ({"attention.context": "striped"}, 2, "attention.context='striped' is unknown"),
])
def test_bad_context_input_is_refused(overrides, sequence, says):
  config = tiny_config(**{**FAMILIES["gpt2"], **overrides})
  shape = {"data": 1, "pipeline": overrides.get("mesh.pipeline", 1), "expert": 1, "sequence": sequence,
           "tensor": 1}
  with pytest.raises(ValueError, match=says):
    check_divides(model_config(config), shape, batch_size=config.batch_size, grad_accum=1, zero=0,
                  pipeline=config.pipeline, context=config.attention.context)


def attention_matmul_flops(strategy_name, shards=4, length=64):
  """Matmul FLOPs per device of one attention call under a strategy, read off the partitioned program."""
  mesh = make_mesh(tiny_config(**{"mesh.sequence": shards, "mesh.data": 8 // shards}).mesh, jax.devices())
  attend = context.strategy(strategy_name, mesh)
  q = jax.ShapeDtypeStruct((8 // shards, length, 4, 16), jnp.float32)
  positions = jnp.asarray(zigzag_order(length, shards))
  lowered = jax.jit(lambda q, k, v: attend(q, k, v, positions, block=512)).lower(q, q, q)
  return analysis.matmul_flops(*analysis.compile_partitioned(lowered))


def test_zigzag_ring_skips_the_fully_masked_quarter_blocks():
  ring, allgather = attention_matmul_flops("ring"), attention_matmul_flops("allgather")
  # Allgather scores every local query against all 4 blocks of keys; the ring scores its own block
  # whole and half of each of the 3 visitors: (1 + 3/2) / 4 of the work.
  assert ring * 8 == allgather * 5, (ring, allgather)
