"""The compiled programs hold the collectives each layout promises (read off the HLO)."""

import collections

import jax

from helpers import compiled_forward, tiny_config
from measure import analysis
from measure.dry_run import compile_partitioned_train_step
from parallel.mesh import DATA, TENSOR
from training.state import param_count, plan
from training.step import compile_train_step


def tensor_all_reduces_per_loop(found):
  per_loop = collections.Counter(c.loop_body for c in found
                                 if c.kind == "all-reduce" and c.axes == (TENSOR,) and c.in_loop)
  return sorted(per_loop.values())


def test_tensor_parallel_forward_has_two_all_reduces_per_layer():
  # Megatron-LM: column-parallel QKV/up need nothing, row-parallel out/down end in one all-reduce each.
  for layers in (2, 4):
    config = tiny_config(**{"mesh.data": 2, "mesh.tensor": 4, "model.num_layers": layers})
    layout = plan(config)
    found = analysis.collectives(compiled_forward(layout, config), layout.mesh)
    assert tensor_all_reduces_per_loop(found) == [2], analysis.summary_table(found)


def test_tensor_parallel_step_has_two_all_reduces_per_layer_each_way():
  config = tiny_config(**{"mesh.data": 2, "mesh.tensor": 4})
  layout = plan(config)
  found = analysis.collectives(compile_train_step(layout, config), layout.mesh)
  # One scanned loop forward, one backward: two all-reduces over `tensor` in each.
  assert tensor_all_reduces_per_loop(found) == [2, 2], analysis.summary_table(found)


def test_llama_s_separate_projections_reduce_their_input_gradients_once():
  # Llama's q, k and v (and gate and up) are separate matmuls: the partitioner all-reduces each one's input
  # gradient (5 backward), and a GPU or TPU compiler sums them first (AllReduceReassociate), as we read it: 2.
  config = tiny_config(**{"model.family": "llama", "model.kv_heads": 2, "mesh.data": 4, "mesh.tensor": 2})
  layout = plan(config)
  compiled, partitioned = compile_partitioned_train_step(layout, config)
  assert tensor_all_reduces_per_loop(analysis.collectives(compiled, layout.mesh, partitioned)) == [2, 2]


def test_data_parallel_step_reduces_every_gradient():
  config = tiny_config(**{"mesh.data": 8})
  layout = plan(config)
  found = analysis.collectives(compile_train_step(layout, config), layout.mesh)
  assert {(c.kind, c.axes) for c in found} == {("all-reduce", (DATA,))}, analysis.summary_table(found)
  # A reduction inside the backward loop runs once per layer.
  reduced = sum(c.result_bytes * (config.model.num_layers if c.in_loop else 1) for c in found)
  gradient_bytes = 4 * param_count(layout)
  # The tied embedding is used twice (lookup and head); XLA may reduce each use's gradient apart.
  tied_embedding_bytes = 4 * layout.model.padded_vocab * layout.model.embed_dim
  assert gradient_bytes <= reduced <= gradient_bytes + tied_embedding_bytes + 64, (
      analysis.summary_table(found))


def sharded_over_data(shardings) -> int:
  return sum(DATA in jax.tree.leaves(tuple(s.spec)) for s in jax.tree.leaves(shardings))


def test_fsdp_gathers_each_weight_where_it_is_used():
  config = tiny_config(**{"mesh.data": 8, "sharding.zero": 3})
  layout = plan(config)
  found = analysis.collectives(compiled_forward(layout, config), layout.mesh)
  table = analysis.summary_table(found)
  # FSDP shards each weight's `embed` axis over data. In a block that is 10 of its 12 weights: both
  # LayerNorms' scale and bias, the QKV and output kernels, the output bias, the MLP's two kernels and
  # its down bias (the QKV and up biases have no `embed` axis and stay whole). Each is gathered once
  # where it is used, in the scanned loop's body (run once per layer), and none twice.
  assert analysis.count_by(found, kind="all-gather", axes=DATA, in_loop=True) == 10, table
  # Outside the loop the token table, the positions and the final LayerNorm's scale and bias; and the
  # batch's token ids (s32[16, 32]), which the partitioner gathers for the lookup in the sharded table.
  assert analysis.count_by(found, kind="all-gather", axes=DATA, in_loop=False) == 4 + 1, table
  outside = {k: v for k, v in layout.param_shardings.items() if k != "blocks"}  # the layout agrees
  assert (sharded_over_data(layout.param_shardings["blocks"]), sharded_over_data(outside)) == (10, 4)


def test_tensor_all_reduces_under_bfloat16_move_half_the_bytes_of_float32():
  # Megatron's bf16 reductions: every activation all-reduce over `tensor` moves bfloat16, the embedding
  # lookup's too; only the loss's per-token max, sum and target logit (and a few scalars) stay float32.
  def tensor_bytes(dtype):
    config = tiny_config(**{"mesh.data": 4, "mesh.tensor": 2, "precision.compute": dtype})
    layout = plan(config)
    compiled, partitioned = compile_partitioned_train_step(layout, config)
    traffic = analysis.traffic_per_step(analysis.collectives(compiled, layout.mesh, partitioned))
    return sum(sent for (_, axes), sent in traffic.items() if axes == TENSOR)

  ratio = tensor_bytes("bfloat16") / tensor_bytes("float32")
  assert 0.49 < ratio < 0.51, ratio
