"""Tests for measure/analysis.py on 8 simulated CPU devices."""

import os

# Until tests/conftest.py sets this for every module, set it before jax loads.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from measure import analysis

AXES = ("data", "pipeline", "expert", "sequence", "tensor")
AUTO = (jax.sharding.AxisType.Auto,) * len(AXES)


def make_mesh(shape):
  return jax.make_mesh(shape, AXES, axis_types=AUTO)


@pytest.fixture(scope="module")
def mesh():
  """data=2 x tensor=4."""
  return make_mesh((2, 1, 1, 1, 4))


def compile_(fn, *args, **jit_kwargs):
  return jax.jit(fn, **jit_kwargs).lower(*args).compile()


def shard_mapped(fn, mesh, in_specs, out_specs, check_vma=True):
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)


def only(found):
  assert len(found) == 1, found
  return found[0]


def test_psum_over_tensor_is_one_all_reduce(mesh):
  x_BD = jnp.ones((8, 16), jnp.float32)
  fn = shard_mapped(lambda x: jax.lax.psum(x, "tensor"), mesh,
                    P("data", "tensor"), P("data"))
  found = analysis.collectives(compile_(fn, x_BD), mesh)
  ar = only(found)
  assert ar.kind == "all-reduce"
  assert ar.axes == ("tensor",)
  assert ar.group_size == 4
  assert not ar.in_loop and ar.loop_body is None
  # Per-device block is f32[4,4].
  assert ar.result_bytes == 4 * 4 * 4
  assert analysis.count_by(found, kind="all-reduce", axes="tensor") == 1
  assert analysis.count_by(found, kind="all-reduce", axes=("data",)) == 0


def test_sharded_contraction_all_reduces_over_tensor(mesh):
  x_BD = jnp.ones((8, 16), jnp.float32)
  w_DF = jnp.ones((16, 32), jnp.float32)
  compiled = compile_(
      lambda x, w: x @ w, x_BD, w_DF,
      in_shardings=(NamedSharding(mesh, P(None, "tensor")),
                    NamedSharding(mesh, P("tensor", None))),
      out_shardings=NamedSharding(mesh, P()))
  found = analysis.collectives(compiled, mesh)
  # XLA names this mesh axis_0/axis_1 in the HLO; we must still say 'tensor'.
  assert "replica_groups=mesh['axis_0'" in compiled.as_text()
  ar = only(found)
  assert (ar.kind, ar.axes, ar.group_size) == ("all-reduce", ("tensor",), 4)
  assert ar.result_bytes == 8 * 32 * 4


def test_all_gather_all_to_all_and_ppermute(mesh):
  x_BD = jnp.ones((8, 16), jnp.float32)
  gather = shard_mapped(lambda x: jax.lax.all_gather(x, "data", tiled=True),
                        mesh, P("data", "tensor"), P(None, "tensor"),
                        check_vma=False)
  ag = only(analysis.collectives(compile_(gather, x_BD), mesh))
  assert (ag.kind, ag.axes, ag.group_size) == ("all-gather", ("data",), 2)
  assert ag.result_bytes == 8 * 4 * 4  # the gathered f32[8,4]

  to_all = shard_mapped(
      lambda x: jax.lax.all_to_all(x, "tensor", 1, 0, tiled=True),
      mesh, P("data", "tensor"), P("data", "tensor"))
  a2a = only(analysis.collectives(compile_(to_all, x_BD), mesh))
  assert (a2a.kind, a2a.axes, a2a.group_size) == ("all-to-all", ("tensor",), 4)
  # The CPU backend prints a tuple of four f32[4,1]; the sum is the block.
  assert a2a.result_bytes == 4 * 4 * 4

  ring = [(i, (i + 1) % 2) for i in range(2)]
  permute = shard_mapped(lambda x: jax.lax.ppermute(x, "data", ring),
                         mesh, P("data", "tensor"), P("data", "tensor"))
  cp = only(analysis.collectives(compile_(permute, x_BD), mesh))
  assert (cp.kind, cp.axes, cp.group_size) == ("collective-permute", ("data",), 2)
  assert analysis.ring_traffic_bytes(cp) == cp.result_bytes == 64


def test_reduce_scatter_over_two_axes_and_bytes():
  mesh = make_mesh((2, 1, 2, 1, 2))
  x_BD = jnp.ones((8, 16), jnp.float32)
  fn = shard_mapped(
      lambda x: jax.lax.psum_scatter(x, ("data", "expert"), scatter_dimension=1,
                                     tiled=True),
      mesh, P(None, "tensor"), P(None, ("tensor", "data", "expert")),
      check_vma=False)
  rs = only(analysis.collectives(compile_(fn, x_BD), mesh))
  assert (rs.kind, rs.axes, rs.group_size) == (
      "reduce-scatter", ("data", "expert"), 4)
  assert rs.result_bytes == 8 * 2 * 4  # f32[8,8] block scattered 4 ways
  # N, the full size, is 256 bytes: each device sends N(D-1)/D = 192.
  assert analysis.ring_traffic_bytes(rs) == 192


def test_psum_in_scan_body_counts_once_per_body(mesh):
  def scanned(x):
    def layer(carry, _):
      def inner(c, _):
        return c + jax.lax.psum(c, "data"), None
      carry = jax.lax.scan(inner, carry, None, length=3)[0]
      return carry * 0.5 + jax.lax.psum(carry, "tensor"), None
    return jax.lax.scan(layer, x, None, length=5)[0]

  fn = shard_mapped(scanned, mesh, P("data", "tensor"), P("data", "tensor"))
  found = analysis.collectives(compile_(fn, jnp.ones((8, 16))), mesh)
  assert len(found) == 2  # not 5 + 15: one per body, not per trip
  by_axes = {c.axes: c for c in found}
  outer, inner = by_axes[("tensor",)], by_axes[("data",)]
  assert outer.loop_depth == 1 and inner.loop_depth == 2
  assert outer.loop_body == outer.computation
  assert inner.loop_body == inner.computation != outer.loop_body
  assert analysis.count_by(found, kind="all-reduce", in_loop=True) == 2
  assert analysis.count_by(found, in_loop=False) == 0
  # Per step, each runs as often as the loops around it: 5 and 5 x 3 times.
  assert (outer.trips, inner.trips) == (5, 15)
  assert analysis.traffic_per_step(found) == {
      ("all-reduce", "tensor"): 5 * analysis.ring_traffic_bytes(outer),
      ("all-reduce", "data"): 15 * analysis.ring_traffic_bytes(inner)}


def test_permuted_device_order_maps_through_positions():
  # HLO ids are positions in the device assignment, not device.id: on this
  # mesh devices 0..3 span both axes, yet the group {0,1,2,3} is 'tensor'.
  devices = np.array(jax.devices()).reshape(4, 2).T.reshape(2, 1, 1, 1, 4)
  mesh = jax.sharding.Mesh(devices, AXES, axis_types=AUTO)
  fn = shard_mapped(lambda x: jax.lax.psum(x, "tensor"), mesh,
                    P("data", "tensor"), P("data"))
  compiled = compile_(fn, jnp.ones((8, 16)))
  assert only(analysis.collectives(compiled, mesh)).axes == ("tensor",)
  assert only(analysis.collectives(compiled.as_text(), mesh)).axes == ("tensor",)


def test_iota_groups_parse_literal_strings():
  assert analysis.iota_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert analysis.iota_groups("[4,2]<=[2,4]T(1,0)") == [
      [0, 4], [1, 5], [2, 6], [3, 7]]
  # Three dims, the middle one outermost after the transpose.
  assert analysis.iota_groups("[2,4]<=[2,2,2]T(1,0,2)") == [
      [0, 1, 4, 5], [2, 3, 6, 7]]
  line = ("%ar = f32[4]{0} all-reduce(%p), channel_id=1, "
          "replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true")
  assert analysis.parse_groups(line, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_other_group_spellings_parse_literal_strings():
  explicit = "all-gather(%p), replica_groups={{0,2},{1,3}}, dimensions={0}"
  assert analysis.parse_groups(explicit, 4) == [[0, 2], [1, 3]]
  assert analysis.parse_groups("all-reduce(%p), replica_groups={}", 4) == [
      [0, 1, 2, 3]]
  mesh_form = "replica_groups=mesh['x'=2,'y'=4] {'y'}, use_global_device_ids=true"
  assert analysis.parse_groups(mesh_form, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  # 'y':(2)2 is the minor half of y: neighbours inside one x row.
  sub_axis = "replica_groups=mesh[x=2,y=4] {y:(2)2}"
  assert sorted(analysis.parse_groups(sub_axis, 8)) == [
      [0, 1], [2, 3], [4, 5], [6, 7]]
  sub_axis = "replica_groups=mesh[x=2,y=4] {x,y:(1)2}"
  assert sorted(analysis.parse_groups(sub_axis, 8)) == [
      [0, 2, 4, 6], [1, 3, 5, 7]]
  non_iota = "replica_groups=mesh['x'=2,'y'=2], device_ids=(3,1,0,2) {'x'}"
  assert sorted(analysis.parse_groups(non_iota, 4)) == [[1, 2], [3, 0]]
  non_iota = "replica_groups=mesh[x=2,y=2], device_ids=([2,2]<=[2,2]T(1,0)) {y}"
  assert sorted(analysis.parse_groups(non_iota, 4)) == [[0, 2], [1, 3]]
  with pytest.raises(ValueError):
    analysis.parse_groups("all-reduce(%p), replica_groups=??", 8)


def test_async_start_counted_once_with_output_bytes(mesh):
  # GPU backends print async pairs; the CPU one does not, so use literal HLO.
  hlo = """HloModule m

ENTRY %main (p: bf16[4,8]) -> bf16[8,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  %ags = (bf16[4,8]{1,0}, bf16[8,8]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %agd = bf16[8,8]{1,0} all-gather-done(%ags)
  %ars = bf16[8,8]{1,0} all-reduce-start(%agd), channel_id=2, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = bf16[8,8]{1,0} all-reduce-done(%ars)
  %cps = (bf16[8,8]{1,0}, bf16[8,8]{1,0}, u32[], u32[]) collective-permute-start(%ard), channel_id=3, source_target_pairs={{0,4},{4,0}}
  ROOT %cpd = bf16[8,8]{1,0} collective-permute-done(%cps)
}
"""
  found = analysis.collectives(hlo, mesh)
  assert [(c.kind, c.axes, c.result_bytes) for c in found] == [
      ("all-gather", ("data",), 8 * 8 * 2),
      ("all-reduce", ("tensor",), 8 * 8 * 2),
      ("collective-permute", ("data",), 8 * 8 * 2)]
  assert analysis.collective_bytes(found) == {
      "all-gather": 128, "all-reduce": 128, "collective-permute": 128}
  # all-gather: 128 * 1/2; all-reduce: 2 * 128 * 3/4; permute: 128.
  assert analysis.collective_bytes(found, ring=True) == {
      "all-gather": 64, "all-reduce": 192, "collective-permute": 128}
  table = analysis.summary_table(found)
  assert len(table.splitlines()) == 4
  assert "all-reduce" in table and "tensor" in table


def test_result_bytes_of_other_dtypes(mesh):
  hlo = """ENTRY %main (p: s8[16]) -> s8[16] {
  %ar = (s8[16]{0}, pred[3]{0}, f8e4m3fn[2,2]{1,0}) all-reduce(%a, %b, %c), replica_groups={{0,1}}, to_apply=%add
}
"""
  assert only(analysis.collectives(hlo, mesh)).result_bytes == 16 + 3 + 4


def test_memory_summary_is_positive(mesh):
  x_BD = jnp.ones((8, 16), jnp.float32)
  fn = shard_mapped(lambda x: jax.lax.psum(x, "tensor"), mesh,
                    P("data", "tensor"), P("data"))
  summary = analysis.memory_summary(compile_(fn, x_BD))
  assert summary["argument_bytes"] == 4 * 4 * 4
  assert summary["output_bytes"] > 0
  assert summary["peak_bytes"] >= summary["argument_bytes"] + summary[
      "output_bytes"] - summary["alias_bytes"] > 0


def test_memory_summary_without_analysis():
  class NoAnalysis:
    def memory_analysis(self):
      return None
  summary = analysis.memory_summary(NoAnalysis())
  assert summary["peak_bytes"] == 0 and summary["temp_bytes"] == 0


def test_partitioned_reading_keeps_bf16_forms_reduce_scatters_and_folds_chains():
  # In a 3-trip loop, a contraction over a batch split on `data` and a length split on `tensor` with a
  # replicated result (the partitioner writes an all-reduce over `tensor` feeding one over `data`) and
  # a bf16 contraction over `tensor`; after it, the first contraction summed into a result split over
  # `data` (an all-reduce over `data` whose one use is the device's half, then a sum over `tensor`).
  mesh = make_mesh((2, 1, 1, 1, 4))
  x_BTD = jax.device_put(jnp.ones((4, 8, 16), jnp.float32), NamedSharding(mesh, P("data", "tensor")))
  h_BF = jax.device_put(jnp.ones((4, 32), jnp.bfloat16), NamedSharding(mesh, P("data", "tensor")))
  w_FD = jax.device_put(jnp.ones((32, 16), jnp.bfloat16), NamedSharding(mesh, P("tensor")))

  def fn(x, h, w):
    def body(carry, _):
      y_BD = jnp.einsum("bf,fd->bd", h, w, preferred_element_type=jnp.bfloat16)
      return carry + y_BD, jnp.einsum("btd,bte->de", x, x)
    y, g = jax.lax.scan(body, jnp.zeros((4, 16), jnp.bfloat16), length=3)
    s = jax.lax.with_sharding_constraint(jnp.einsum("btd,bte->de", x, x), NamedSharding(mesh, P("data")))
    return g, y, s

  compiled, partitioned = analysis.compile_partitioned(jax.jit(fn).lower(x_BTD, h_BF, w_FD))
  found = analysis.collectives(compiled, mesh, partitioned)
  assert analysis.traffic_per_step(found) == {
      # f32[16,16], 1024 bytes, over all 8 devices, 3 trips: 3 x 2 x 1024 x 7/8.
      ("all-reduce", "data+tensor"): 5376,
      # bf16[2,16], 64 bytes, over 4 devices, 3 trips: 3 x 2 x 64 x 3/4; then f32[8,16]: 2 x 512 x 3/4.
      ("all-reduce", "tensor"): 288 + 768,
      # f32[16,16] scattered 2 ways: each device sends its 512-byte half once.
      ("reduce-scatter", "data"): 512}
  backend = analysis.traffic_per_step(analysis.collectives(compiled, mesh))
  assert {key for key in backend if key[0] == "reduce-scatter" or key[1] == "data+tensor"} == set(), backend


def test_matmul_flops_count_loop_trips_and_a_conditional_s_costliest_branch(mesh):
  a = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P()))  # placed, so the partitioner runs

  def run(a, flag):
    def body(carry, _):  # 5 trips of a 32 x 64 x 64 product
      return carry @ jnp.ones((64, 64)), None
    looped, _ = jax.lax.scan(body, a, None, length=5)
    # One branch multiplies by a 64 x 128 matrix, the other by 64 x 8: a device runs one of them.
    branch = jax.lax.cond(flag, lambda x: (x @ jnp.ones((64, 128))).sum(), lambda x: (x @ jnp.ones((64, 8))).sum(),
                          looped)
    return branch

  lowered = jax.jit(run).lower(a, True)
  assert analysis.matmul_flops(*analysis.compile_partitioned(lowered)) == 2 * 32 * 64 * (5 * 64 + 128)


def test_busy_counts_a_conditional_in_a_loop_on_that_many_trips(mesh):
  a = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P()))

  def run(a):
    def tick(carry, t):  # a 32 x 64 x 64 product under a cond, in each of 6 trips
      return jax.lax.cond(t < 2, lambda x: x @ jnp.ones((64, 64)), lambda x: x, carry), None
    return jax.lax.scan(tick, a, jnp.arange(6))[0].sum()

  compiled, partitioned = analysis.compile_partitioned(jax.jit(run).lower(a))
  product = 2 * 32 * 64 * 64
  assert analysis.matmul_flops(compiled, partitioned) == 6 * product
  assert analysis.matmul_flops(compiled, partitioned, busy={6: 2}) == 2 * product
  assert analysis.matmul_flops(compiled, partitioned, busy={5: 2}) == 6 * product  # another loop's trips


def test_a_one_device_program_is_read_before_optimisations():
  lowered = jax.jit(lambda a: (a @ a).sum()).lower(jnp.ones((8, 8)))
  assert analysis.matmul_flops(*analysis.compile_partitioned(lowered)) == 2 * 8 * 8 * 8
