"""The analytic estimate (parallel/estimate.py) against the compiled program, over a grid of layouts.

Each layout's train step is compiled once (tiny GPT-2, float32). Memory: the
estimated params + optimizer state + batch against XLA's argument bytes, and
gradients + activations against its temporary bytes, within 15%. Collectives:
the bytes each device sends per step, per kind and mesh axes, within 15%.

Where the compiled program does something other than the textbook layout,
the estimate stays textbook, and BY_HAND holds, worked out by hand, both the
textbook figures (which the estimate must equal exactly) and what the program
sends instead (which it must send within 15%; None where it sends the
textbook), one documented rewrite each (also listed in the README):
- fsdp: XLA on the CPU does not form reduce-scatters; the gradient is
  all-reduced whole and each device slices its shard (2x the bytes).
  A pair of all-to-alls re-lays the tied embedding's gradient shards.
- sequence: the gradient all-reduce over data x sequence runs as one
  all-reduce over `sequence` and then one over `data`.
"""

import pytest

from conftest import tiny_config
from configs.gpt2 import get_config
from parallel import analysis, estimate
from training.dry_run import compile_train_step, model_weights
from training.state import plan

TOLERANCE = 0.15
LAYOUTS = {
    "data=8": {"mesh.data": 8},
    "data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2},
    "fsdp data=8": {"mesh.data": 8, "sharding.zero": 3},
    "data=2 x tensor=4": {"mesh.data": 2, "mesh.tensor": 4},
    "data=4 x pipeline=2": {"mesh.data": 4, "mesh.pipeline": 2},
    "data=2 x sequence=4": {"mesh.data": 2, "mesh.sequence": 4},
}


# The tiny GPT-2 (2 layers, d = 64, MLP 256, 32 tokens, vocabulary 256, float32), in elements: 99968 in
# the two layers (test_benchmark.py counts them), of which 896 have no `embed` axis (the QKV and MLP-up
# biases, 2 x (3 x 4 x 16 + 256)); 18560 outside them (positions 32 x 64, the 256 x 64 token table and the
# final LayerNorm 2 x 64); 118528 in all. The token table's two uses (lookup and head) are reduced apart,
# so the gradient reduced is 4 x (118528 + 16384) = 539648 bytes. One pipeline micro-batch's activations
# (batch 16 / 4 data / 4 micro-batches = 1 sequence) are 32 x 64 x 4 = 8192 bytes. The ring bytes one
# device sends (parallel/estimate.py): all-reduce 2N(D-1)/D, all-gather and reduce-scatter N(D-1)/D.

# layout -> (the textbook estimate, what the compiled program sends or None, keys it adds that stay under 15% of it)
BY_HAND = {
    "fsdp data=8": (
        # Gradients with an `embed` axis reduce-scattered, the table twice: 4 x (118528 - 896 + 16384) x 7/8;
        # the 896 bias elements FSDP leaves whole all-reduced: 2 x 4 x 896 x 7/8; the weights gathered where
        # used, stacked ones in the forward and the backward loop: 4 x (2 x (99968 - 896) + 18560) x 7/8.
        {("reduce-scatter", "data"): 469056, ("all-reduce", "data"): 6272, ("all-gather", "data"): 758464},
        # Every gradient all-reduced whole instead, the table's two uses summed first: 2 x 4 x 118528 x 7/8.
        {("all-reduce", "data"): 829696, ("all-gather", "data"): 758464},
        {("all-to-all", "data")}),
    "data=4 x pipeline=2": (
        # Once per step, over data a stage's half of the stacked weights, 2 x 4 x 99968 / 2 x 3/4, and over
        # all 8 devices the unstacked ones (the table's two uses summed on each device first),
        # 2 x 4 x 18560 x 7/8. Over pipeline, the last stage's outputs (4 micro-batches) scattered to the
        # stages for the head and their gradients back, 2 x (4 x 8192 x 1/2); hand-offs one each way per
        # tick, M + P - 1 = 5 ticks: 2 x 5 x 8192.
        {("all-reduce", "data"): 299904, ("all-reduce", "data+pipeline"): 129920,
         ("all-to-all", "pipeline"): 32768, ("collective-permute", "pipeline"): 81920},
        None,
        # The gradient norm's and the finiteness check's per-leaf partial sums over the stages: 264 bytes.
        {("all-reduce", "pipeline")}),
    "data=2 x sequence=4": (
        # The gradient over all 8 devices: 2 x 539648 x 7/8. K and V of each of 2 layers gathered forward
        # (8 sequences x 32 tokens x 64 x 4 bytes = 65536 each, whole): 2 x 2 x 65536 x 3/4; their
        # gradients reduce-scattered backward, the same.
        {("all-reduce", "data+sequence"): 944384, ("all-gather", "sequence"): 196608,
         ("reduce-scatter", "sequence"): 196608},
        # The gradient all-reduced over sequence, 2 x 539648 x 3/4, then over data, 2 x 539648 x 1/2.
        {("all-reduce", "sequence"): 809472, ("all-reduce", "data"): 539648,
         ("all-gather", "sequence"): 196608, ("reduce-scatter", "sequence"): 196608},
        set()),
}


@pytest.fixture(scope="module")
def compiled():
  """Every layout's config, mesh, weights and compiled train step, compiled once for the module."""
  out = {}
  for name, overrides in LAYOUTS.items():
    config = tiny_config(**overrides)
    layout = plan(config)
    out[name] = (config, dict(layout.mesh.shape), model_weights(config),
                 compile_train_step(layout, config), layout.mesh)
  return out


def assert_close(estimated, measured, what):
  assert abs(measured - estimated) <= TOLERANCE * measured, (
      f"{what}: estimate {estimated:,} vs compiled {measured:,} ({measured / max(estimated, 1):.2f}x)")


def test_textbook_gpt2_1558m_on_one_device():
  # MLSysBook ch. 18: 1.5B fp32 parameters need about 6 GB each for params, grads, m and v.
  config = get_config("1558m")
  memory = estimate.memory(config, {a: 1 for a in ("data", "pipeline", "expert", "sequence", "tensor")},
                           model_weights(config))
  for value in (memory["params"], memory["grads"], memory["opt_state"] / 2):
    assert 5.8e9 < value < 6.5e9, memory


@pytest.mark.parametrize("name", LAYOUTS)
def test_memory_estimate_matches_compiled(name, compiled):
  config, mesh, weights, program, _ = compiled[name]
  memory, measured = estimate.memory(config, mesh, weights), analysis.memory_summary(program)
  assert_close(memory["params"] + memory["opt_state"] + memory["batch"], measured["argument_bytes"],
               f"{name} arguments")
  assert_close(memory["grads"] + memory["activations"], measured["temp_bytes"], f"{name} temporaries")


@pytest.mark.parametrize("name", BY_HAND)
def test_collective_estimate_is_the_textbook_by_hand(name):
  config = tiny_config(**LAYOUTS[name])
  mesh = dict(plan(config).mesh.shape)
  assert estimate.collectives(config, mesh, model_weights(config)) == BY_HAND[name][0]


@pytest.mark.parametrize("name", LAYOUTS)
def test_collective_estimate_matches_compiled(name, compiled):
  config, mesh, weights, program, mesh_object = compiled[name]
  _, instead, extra = BY_HAND.get(name, (None, None, set()))
  # Where the program departs from the textbook, what it sends instead, by hand.
  expected = estimate.collectives(config, mesh, weights) if instead is None else instead
  sent = analysis.traffic_per_step(analysis.collectives(program, mesh_object))
  table = analysis.summary_table(analysis.collectives(program, mesh_object))
  assert set(sent) - extra == set(expected), table
  for key in expected:
    assert_close(expected[key], sent[key], f"{name} {key}")
  assert sum(sent[key] for key in extra) <= TOLERANCE * sum(sent.values()), table
