"""The analytic estimate (measure/estimate.py) against the compiled program, over a grid of layouts.

Each layout's train step is compiled once (tiny GPT-2, float32). Memory: the
estimated params + optimizer state + batch against XLA's argument bytes, and
gradients + activations against its temporary bytes, within 15%. Collectives:
the bytes each device sends per step, per kind and mesh axes, read off the
program as partitioned, before the CPU backend's passes (what a GPU or TPU
compiler receives, measure/analysis.py), within 10%. FLOPs per device: the
estimated matmul FLOPs against the partitioned program's dots (loops times
their trips, a pipeline's lax.cond slots on the ticks its schedule fills),
within 10% on every layout.

BY_HAND holds, worked out by hand, the textbook figures the estimate must
equal exactly; the compiled program sends each within 10%, plus only the
small extra keys listed with it (partial sums no layout accounts for).
"""

import contextlib
import io
import subprocess
import sys

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from configs.gpt2 import get_config
from helpers import ROOT, tiny_config
from measure import analysis, estimate
from measure.dry_run import busy_slots, compile_partitioned_train_step, model_weights
from model.mlp import Mlp
from training.state import model_config, plan

TOLERANCE = 0.15  # memory
COLLECTIVE_TOLERANCE = 0.10
LAYOUTS = {
    "data=8": {"mesh.data": 8},
    "data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2},
    "fsdp data=8": {"mesh.data": 8, "sharding.zero": 3},
    "data=2 x tensor=4": {"mesh.data": 2, "mesh.tensor": 4},
    "data=4 x pipeline=2": {"mesh.data": 4, "mesh.pipeline": 2},
    "data=4 x pipeline=2, 1f1b": {"mesh.data": 4, "mesh.pipeline": 2, "pipeline.schedule": "1f1b"},
    "data=4 x pipeline=2, 1 + 2 layers": {"mesh.data": 4, "mesh.pipeline": 2, "model.num_layers": 3,
                                          "pipeline.first_stage_layers": 1, "pipeline.last_stage_layers": 2},
    "data=2 x sequence=4": {"mesh.data": 2, "mesh.sequence": 4},
    "moe data=2 x expert=4": {"mesh.data": 2, "mesh.expert": 4, "moe.experts": 4},
    # DeepSeek's layout: a first dense layer of its own stack before the routed ones.
    "moe, a dense first layer, data=2 x expert=4": {"mesh.data": 2, "mesh.expert": 4, "moe.experts": 4,
                                                    "model.num_layers": 3, "moe.first_dense": 1},
    "data=8, activations recomputed": {"mesh.data": 8, "model.recompute_activation": True},
    # Latents a third of the width, so that counting the heads' gradients summed at the input instead of at the
    # latents would miss the tensor all-reduce's bytes by 15%.
    "latent attention, data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "model.family": "llama",
                                            "mla.kv_rank": 8, "mla.q_rank": 8, "mla.rope_dim": 4, "mla.v_dim": 8},
    # One multi-token prediction module (model/mtp.py): one block (routed where the layers are), a lookup and a head
    # more, the weights outside the layers reduced (or scattered) once per use, the module's own gathered once.
    "multi-token prediction, data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "model.mtp_depth": 1},
    "multi-token prediction, fsdp data=8": {"mesh.data": 8, "sharding.zero": 3, "model.mtp_depth": 1},
    "moe, multi-token prediction, data=2 x expert=4": {"mesh.data": 2, "mesh.expert": 4, "moe.experts": 4,
                                                       "model.mtp_depth": 1},
    # Preference pairs (training/preference.py): two sequences a pair, and the reference held beside the weights,
    # run forward once (its tensor all-reduces, and under ZeRO-3 its gathers, once more). 8 pairs: the 16 rows
    # the other layouts run.
    "dpo, data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "objective": "dpo", "batch_size": 8},
    "dpo, fsdp data=8": {"mesh.data": 8, "sharding.zero": 3, "objective": "dpo", "batch_size": 8},
    # GRPO (training/grpo.py) with its KL term: a rollout's four [B, T] entries, and the reference run forward once.
    "grpo, data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "objective": "grpo", "grpo.beta": 0.1},
    # LoRA (training/lora.py): the adapted kernels' gradients reduced as a weight's, the others' none; under ZeRO the
    # factor without `embed` sums its own over `data`; moments for the factors alone.
    "lora, data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "lora.rank": 4, "lora.targets": "attention,mlp"},
    "lora, bfloat16 base, data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "lora.rank": 4,
                                               "lora.targets": "attention,mlp", "lora.frozen_dtype": "bfloat16"},
    "lora, fsdp data=8": {"mesh.data": 8, "sharding.zero": 3, "lora.rank": 4, "lora.targets": "attention,mlp"},
    "muon fsdp data=8": {"mesh.data": 8, "sharding.zero": 3, "optimizer.name": "muon"},
    "muon gathered, data=2 x tensor=4": {"mesh.data": 2, "mesh.tensor": 4, "optimizer.name": "muon",
                                         "optimizer.muon_iteration": "gathered"},
}


# The tiny GPT-2 (2 layers, d = 64, MLP 256, 32 tokens, vocabulary 256, float32), in elements: 99968 in
# the two layers (test_benchmark.py counts them), of which 896 have no `embed` axis (the QKV and MLP-up
# biases, 2 x (3 x 4 x 16 + 256)); 18560 outside them (positions 32 x 64, the 256 x 64 token table and the
# final LayerNorm 2 x 64); 118528 in all. The token table's two uses (lookup and head) are reduced apart,
# so the gradient reduced is 4 x (118528 + 16384) = 539648 bytes. One pipeline micro-batch's activations
# (batch 16 / 4 data / 4 micro-batches = 1 sequence) are 32 x 64 x 4 = 8192 bytes. The ring bytes one
# device sends (measure/estimate.py): all-reduce 2N(D-1)/D, all-gather and reduce-scatter N(D-1)/D.

# layout -> (the textbook estimate, what the compiled program sends or None for the textbook, keys it adds
# that stay under 10% of it)
BY_HAND = {
    "fsdp data=8": (
        # Gradients with an `embed` axis reduce-scattered, the table's two uses summed first:
        # 4 x (118528 - 896) x 7/8; the 896 bias elements FSDP leaves whole all-reduced: 2 x 4 x 896 x 7/8;
        # the weights gathered where used, stacked ones in the forward and the backward loop:
        # 4 x (2 x (99968 - 896) + 18560) x 7/8.
        {("reduce-scatter", "data"): 411712, ("all-reduce", "data"): 6272, ("all-gather", "data"): 758464},
        # A pair of all-to-alls re-lays the lookup's share of the table's gradient.
        None, {("all-to-all", "data")}),
    "muon fsdp data=8": (
        # As fsdp data=8, and Muon dealing its matrices round robin (training/muon.py): the eight 64 x 64 (each
        # layer's q, k, v and output) as one stack, one a device, and the four 64 x 256 (MLP up, and down
        # transposed) padded to eight. Their float32 momentum crosses an all-to-all over data and one back:
        # 2 x 4 x (8 x 4096 + 8 x 16384) / 8 x 7/8.
        {("reduce-scatter", "data"): 411712, ("all-reduce", "data"): 6272, ("all-gather", "data"): 758464,
         ("all-to-all", "data"): 143360},
        # The lookup's pair of all-to-alls (as fsdp data=8) beside them: 28672 more.
        {("reduce-scatter", "data"): 411712, ("all-reduce", "data"): 6272, ("all-gather", "data"): 758464,
         ("all-to-all", "data"): 172032}, set()),
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
        # The position table's gradient, summed over `sequence` where its rows were gathered, and a
        # [batch, embed] float32 term over `data`.
        None, {("all-reduce", "sequence"), ("all-reduce", "data")}),
}


# Keys the compiled program adds beside a textbook it otherwise matches: the router's scalar statistics.
EXTRA_KEYS = {"moe data=2 x expert=4": {("all-reduce", "expert")},
              "moe, a dense first layer, data=2 x expert=4": {("all-reduce", "expert")},
              "moe, multi-token prediction, data=2 x expert=4": {("all-reduce", "expert")},
              # As fsdp data=8 (BY_HAND): the lookup's pair of all-to-alls.
              "multi-token prediction, fsdp data=8": {("all-to-all", "data")},
              "dpo, fsdp data=8": {("all-to-all", "data")},
              "lora, fsdp data=8": {("all-to-all", "data")},
              # As under gpipe (BY_HAND): the gradient norm's per-leaf partial sums over the stages.
              "data=4 x pipeline=2, 1f1b": {("all-reduce", "pipeline")},
              "data=4 x pipeline=2, 1 + 2 layers": {("all-reduce", "pipeline")}}
# The activation estimate does not model MoE's dispatch and combine tensors (1.67x low), and is 0.8x of what a
# stage of two layers holds (equal stages too: 4 layers over pipeline=2 compile to 6.16 MB against 4.87 MB).
MEMORY_LAYOUTS = [name for name in LAYOUTS if not name.startswith("moe") and "layers" not in name]


@pytest.fixture(scope="module")
def compiled():
  """Every layout's config, mesh, weights and compiled train step, compiled once for the module."""
  out = {}
  for name, overrides in LAYOUTS.items():
    config = tiny_config(**overrides)
    layout = plan(config)
    out[name] = (config, dict(layout.mesh.shape), model_weights(config),
                 compile_partitioned_train_step(layout, config), layout.mesh)
  return out


def assert_close(estimated, measured, what, tolerance=TOLERANCE):
  assert abs(measured - estimated) <= tolerance * measured, (
      f"{what}: estimate {estimated:,} vs compiled {measured:,} ({measured / max(estimated, 1):.2f}x)")


def test_readme_longest_context_table_is_what_the_tool_prints_at_this_commit():
  # The textbook's long-context table beside meshlm's: a change to the estimator must regenerate it
  # (python tools/longest_context.py --write).
  printed = subprocess.run([sys.executable, "tools/longest_context.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True, timeout=120).stdout
  page = (ROOT / "docs" / "long_context.md").read_text()
  block = page[page.index("<!-- longest-context -->\n") + len("<!-- longest-context -->\n"):]
  assert block.startswith(printed), ("docs/long_context.md's longest-context table is stale: "
                                     "run tools/longest_context.py --write")


def test_longest_context_compile_check_prints_xla_peaks_near_the_estimate():
  # The code path of `tools/longest_context.py --compile`, on the tiny Llama at the length 50 MB allows
  # on one device (three strategies, one program: one device has no sequence axis to differ over).
  printed = subprocess.run([sys.executable, "tools/longest_context.py", "--config=configs/llama.py:tiny", "--compile",
                            "--memory_gb=0.05", "--devices=1", "--mlp_chunk=0"], cwd=ROOT, capture_output=True,
                           text=True, check=True, timeout=240).stdout
  rows = [line.split(" | ") for line in printed.splitlines()[2:]]
  assert [row[1] for row in rows] == ["allgather", "ring", "ulysses"]
  for row in rows:
    assert row[4] == "1,024" and 0.9 <= float(row[-1].rstrip(" |")) <= 1.1, row


def test_textbook_gpt2_1558m_on_one_device():
  # MLSysBook ch. 18: 1.5B fp32 parameters need about 6 GB each for params, grads, m and v.
  config = get_config("1558m")
  memory = estimate.memory(config, {a: 1 for a in ("data", "pipeline", "expert", "sequence", "tensor")},
                           model_weights(config))
  for value in (memory["params"], memory["grads"], memory["opt_state"] / 2):
    assert 5.8e9 < value < 6.5e9, memory


def test_full_offload_moves_every_block_input_to_host_memory():
  # GPT-2 124M, batch 8 x 1,024 tokens on one device, bf16: full remat keeps 12 block inputs of
  # 8 x 1024 x 768 x 2 bytes on the device; full_offload keeps them in host memory instead.
  config = get_config("124m")
  config.batch_size, config.precision.compute = 8, "bfloat16"
  mesh = {a: 1 for a in ("data", "pipeline", "expert", "sequence", "tensor")}
  weights, block_input = model_weights(config), 8 * 1024 * 768 * 2
  config.model.remat = "full"
  full = estimate.memory(config, mesh, weights)["activations"]
  assert estimate.host_memory(config, mesh) == 0
  config.model.remat = "full_offload"
  assert full - estimate.memory(config, mesh, weights)["activations"] == 12 * block_input
  assert estimate.host_memory(config, mesh) == 12 * block_input


@pytest.mark.parametrize("overrides, block_input, attention_out", [
    # Tiny GPT-2, float32: at data=8 a device runs 2 sequences x 32 positions, its block input and attention
    # output 64 wide (4 heads of 16): 2 x 32 x 64 x 4 bytes each. At data=4 x tensor=2 it runs 4 sequences,
    # and the attention output holds 2 of the 4 heads.
    ({"mesh.data": 8}, 16384, 16384),
    ({"mesh.data": 4, "mesh.tensor": 2}, 32768, 16384)])
def test_saved_per_layer_is_what_each_remat_policy_saves(overrides, block_input, attention_out):
  # full keeps the block input; save_attention also attention's output (by name); offload keeps the block
  # input and parks the output in host memory; full_offload parks the block input.
  expected = {"full": (block_input, 0), "save_attention": (block_input + attention_out, 0),
              "offload": (block_input, attention_out), "full_offload": (0, block_input)}
  for remat, (device, host) in expected.items():
    config = tiny_config(**overrides, **{"model.remat": remat})
    assert estimate.saved_per_layer(config, dict(plan(config).mesh.shape)) == {"device": device, "host": host}, remat


@pytest.mark.parametrize("family, recompute, listed", [
    ("gpt2", False, 5), ("llama", False, 6), ("gpt2", True, 1), ("llama", True, 2)])
def test_widening_the_mlp_grows_what_a_layer_saves_as_jax_lists_the_mlp_residuals(family, recompute, listed):
  # Without remat a layer saves every hidden value of its MLP that autodiff keeps: 256 more hidden units
  # save that many more per value jax lists for the family's MLP alone, per token (64 on a device at
  # data=8), in float32; under tensor=2 half the units, on twice the tokens. GELU keeps five, its input
  # and output among them; folded into the down projection (model.recompute_activation) its input alone.
  # SwiGLU keeps six; folded, two: its gate and the up projection.
  fields = {"model.family": family, "model.recompute_activation": recompute}
  cfg = model_config(tiny_config(**fields))
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(Mlp(cfg, nnx.Rngs(0)))
  residuals = io.StringIO()
  with contextlib.redirect_stdout(residuals):  # differentiated by its weights too, as training does
    print_saved_residuals(lambda params, x: nnx.merge(graphdef, params)(x), params, jnp.zeros((2, 32, cfg.embed_dim)))
  hidden = residuals.getvalue().count(f"[2,32,{cfg.mlp_dim}]")
  assert hidden == listed, residuals.getvalue()
  for mesh, tokens, units in (({"mesh.data": 8}, 64, 256), ({"mesh.data": 4, "mesh.tensor": 2}, 128, 128)):
    narrow, wide = (tiny_config(**mesh, **fields, **{"model.mlp_dim": width}) for width in (256, 512))
    saved = [estimate.saved_per_layer(c, dict(plan(c).mesh.shape))["device"] for c in (narrow, wide)]
    assert saved[1] - saved[0] == hidden * units * tokens * 4, (family, mesh, hidden)


@pytest.mark.parametrize("name", MEMORY_LAYOUTS)
def test_memory_estimate_matches_compiled(name, compiled):
  config, mesh, weights, (program, _), _ = compiled[name]
  memory, measured = estimate.memory(config, mesh, weights), analysis.memory_summary(program)
  assert_close(memory["params"] + memory.get("reference", 0) + memory["opt_state"] + memory["batch"],
               measured["argument_bytes"],
               f"{name} arguments")
  assert_close(memory["grads"] + memory["activations"], measured["temp_bytes"], f"{name} temporaries")


@pytest.mark.parametrize("name", BY_HAND)
def test_collective_estimate_is_the_textbook_by_hand(name):
  config = tiny_config(**LAYOUTS[name])
  mesh = dict(plan(config).mesh.shape)
  assert estimate.collectives(config, mesh, model_weights(config)) == BY_HAND[name][0]


def test_expert_all_to_all_estimate_by_hand():
  # 4 experts, top-2, capacity ceil(1.25 x 32 tokens x 2 / 4) = 20 slots per sequence; 16 / (2 x 4) = 2
  # sequences per device: 4 x 2 x 20 x 64 x 4 bytes = 40960 per all-to-all, sending 3/4 of it; two
  # all-to-alls each way per layer, forward and backward, 2 layers: 2 x 2 x 2 x 30720.
  config = tiny_config(**LAYOUTS["moe data=2 x expert=4"])
  sent = estimate.collectives(config, dict(plan(config).mesh.shape), model_weights(config))
  assert sent[("all-to-all", "expert")] == 245760


@pytest.mark.parametrize("name", LAYOUTS)
def test_collective_estimate_matches_compiled(name, compiled):
  config, mesh, weights, (program, partitioned), mesh_object = compiled[name]
  textbook = estimate.collectives(config, mesh, weights)
  _, expected, extra = BY_HAND.get(name, (None, None, EXTRA_KEYS.get(name, set())))
  expected = expected or textbook  # where the program departs from the textbook: what it sends instead
  found = analysis.collectives(program, mesh_object, partitioned, busy_slots(config, mesh))
  sent, table = analysis.traffic_per_step(found), analysis.summary_table(found)
  assert set(sent) - extra == set(expected), table
  for key in expected:
    assert_close(expected[key], sent[key], f"{name} {key}", COLLECTIVE_TOLERANCE)
  assert sum(sent[key] for key in extra) <= COLLECTIVE_TOLERANCE * sum(sent.values()), table


def test_a_loss_in_many_chunks_reduces_the_head_gradient_once():
  # 16 chunks of 2 positions (model.loss_chunk=4 tokens per device, 2 rows per device): each device sums
  # the head's gradient over its chunks and the devices reduce it once, as with one chunk (a replicated
  # running sum was all-reduced chunk by chunk: 3.1x the estimate's all-reduce bytes).
  config = tiny_config(**{"mesh.data": 8, "model.loss_chunk": 4})
  layout = plan(config)
  program, partitioned = compile_partitioned_train_step(layout, config)
  sent = analysis.traffic_per_step(analysis.collectives(program, layout.mesh, partitioned))
  key = ("all-reduce", "data")
  assert_close(estimate.collectives(config, dict(layout.mesh.shape), model_weights(config))[key], sent[key],
               f"{key} over 16 loss chunks", COLLECTIVE_TOLERANCE)


@pytest.mark.parametrize("experts", [0, 8])
def test_hybrid_sharding_shards_within_groups_and_reduces_across_them(experts):
  # sharding.fsdp_group=4 on data=8: two replicas of 4-way ZeRO-3. Within a group (`expert`) the weights
  # are gathered and the gradients reduce-scattered; across the groups (`data`) each shard's gradient is
  # all-reduced. Only the weights outside the layers (tables, final norm) have their gradient all-reduced
  # over all 8 devices and sliced, XLA's choice: 11% of the bytes. With experts, each group holds its
  # experts split over its devices, neither gathered nor scattered: their gradients cross the groups only.
  config = tiny_config(**{"mesh.data": 8, "sharding.zero": 3, "sharding.fsdp_group": 4, "moe.experts": experts})
  layout = plan(config)
  assert dict(layout.mesh.shape)["data"] == 2 and dict(layout.mesh.shape)["expert"] == 4
  program, partitioned = compile_partitioned_train_step(layout, config)
  sent = analysis.traffic_per_step(analysis.collectives(program, layout.mesh, partitioned))
  textbook = estimate.collectives(config, dict(layout.mesh.shape), model_weights(config))
  for key in [("all-gather", "expert"), ("reduce-scatter", "expert"), ("all-reduce", "data")]:
    assert_close(textbook[key], sent[key], f"hsdp {key}", COLLECTIVE_TOLERANCE)
  assert sent[("all-reduce", "data+expert")] <= 0.15 * sum(sent.values())
  if experts:
    assert_close(textbook[("all-to-all", "expert")], sent[("all-to-all", "expert")], "hsdp experts' all-to-all",
                 COLLECTIVE_TOLERANCE)


def test_zero3_gathers_in_the_compute_dtype_by_hand():
  # bf16 compute, data=8, ZeRO-3: the partitioned program gathers each matrix after its bf16 cast (read off
  # its HLO: bf16[64,3,4,16], bf16[256,64], ...), norms, biases and positions as float32, and the tied table
  # once, cast for the head (its lookup reads the local columns). Stacked, forward and backward:
  # 2 x (2 layers x 49152 matrix elements x 2 bytes + 2 x 6 x 64 vector elements x 4 bytes); once: positions
  # 32 x 64 x 4, the final LayerNorm 2 x 64 x 4 and the table 256 x 64 x 2; 440832 x 7/8 = 385728
  # (the compiled program: 385504).
  config = tiny_config(**{"mesh.data": 8, "sharding.zero": 3, "precision.compute": "bfloat16"})
  sent = estimate.collectives(config, dict(plan(config).mesh.shape), model_weights(config))
  assert sent[("all-gather", "data")] == 385728


# FLOPs per device of the tiny GPT-2 at data=8, by hand: 16 x 32 / 8 = 64 tokens per device. Each layer's
# matrices hold 49152 elements (QKV 64 x 192, out 64 x 64, MLP 64 x 256 twice) and the tied head 256 x 64:
# 6 x (2 x 49152 + 16384) x 64 = 44040192. Attention's QK^T and PV over the full 32 x 32 (XLA masks the
# causal half, it does not skip it): 12 x 32 tokens x 64 per token per layer, 12 x 32 x 64 x 2 x 64 =
# 3145728. In all 47185920; the compiled program's dots: 47251456 (the loss's one-hot contraction beside).
TINY_DATA8_FLOPS = 47185920


def test_flops_estimate_by_hand():
  config = tiny_config(**LAYOUTS["data=8"])
  mesh, weights = dict(plan(config).mesh.shape), model_weights(config)
  assert estimate.flops(config, mesh, weights)["total"] == TINY_DATA8_FLOPS
  assert estimate.ideal_flops(config, mesh, weights) == TINY_DATA8_FLOPS
  # remat="full" reruns each layer's forward but its MLP output projection (2 x 64 x 256 x 64 tokens):
  # 2 layers x (2 x 49152 + 4 x 32 x 64) x 64 - 2 x 2097152 = 9437184 more.
  config.model.remat = "full"
  assert estimate.flops(config, mesh, weights)["total"] == TINY_DATA8_FLOPS + 9437184
  # Muon iterates five times on each whole matrix on every device: per layer q, k, v and out (64 x 64,
  # 6 x 64^3 a step) and MLP up and down (64 x 256: 4 x 64^2 x 256 + 2 x 64^3), 5 x (4 x 1572864 + 2 x 4718592)
  # = 78643200, two layers.
  config.model.remat, config.optimizer.name = "none", "muon"
  assert estimate.flops(config, mesh, weights)["optimizer"] == 157286400
  # ZeRO-3 splits the matrices over the 8 devices, and round robin deals them: the eight 64 x 64 one a device,
  # the four 64 x 256 padded to eight, one a device: 5 x 1572864 + 5 x 4718592.
  config.sharding.zero = 3
  assert estimate.flops(config, mesh, weights)["optimizer"] == 31457280


@pytest.mark.parametrize("name", LAYOUTS)
def test_flops_estimate_matches_compiled(name, compiled):
  config, mesh, weights, (program, partitioned), _ = compiled[name]
  assert_close(estimate.flops(config, mesh, weights)["total"],
               analysis.matmul_flops(program, partitioned, busy_slots(config, mesh)),
               f"{name} FLOPs", COLLECTIVE_TOLERANCE)
