"""The achievable fraction of peak for each device kind, calibrated once on one published training run.

measure/step_time.py prices each part of a step's FLOPs at peak x this fraction
(its bytes at the HBM bandwidth, no fraction); it stands for everything the model
leaves out (kernels below their roofline, launch gaps, imperfect overlap), so it
is set where a real run says: for each kind, the fraction at which step_time predicts that run's
measured step time, its layout and model as published. Every other published
run is then a check, not a fit (docs/planning.md). Step times come from each
source's tokens/s (its FLOP counting differs from run to run; tokens do not).
"""

import dataclasses
import functools

from configs.base import base
from configs.load import set_fields
from measure import hardware, step_time
from parallel.mesh import DATA, EXPERT, hybrid_shape, mesh_shape

# The shapes the references train: (family, layers, heads, kv heads, width, MLP width, vocabulary).
MPT_7B = ("gpt2", 32, 32, 32, 4096, 16384, 50368)  # mosaicml/llm-foundry yamls/pretrain/mpt-7b.yaml
LLAMA3_8B = ("llama", 32, 32, 8, 4096, 14336, 128256)
LLAMA3_70B = ("llama", 80, 64, 8, 8192, 28672, 128256)
LLAMA3_405B = ("llama", 126, 128, 8, 16384, 53248, 128256)
# MaxText's 2023 synthetic models (global_parameter_scale): head_dim 256, a non-gated MLP, tied embeddings.
MAXTEXT_22B = ("gpt2", 48, 24, 24, 6144, 24576, 32768)
# The 16B has 32 heads of 256 over a width of 5,120; meshlm splits the width into its heads, so 20 of
# 256 here: attention projections 5,120 wide, not 8,192 (12% fewer matmul FLOPs per layer).
MAXTEXT_16B = ("gpt2", 32, 20, 20, 5120, 32768, 32768)


@dataclasses.dataclass(frozen=True)
class Reference:
  """One measured run: what trained, on what layout, and its step time."""
  label: str
  source: str
  shape: tuple  # (family, layers, heads, kv heads, width, MLP width, vocabulary)
  seq_len: int
  batch: int  # sequences per step, all devices
  devices: int
  flags: dict  # the layout as meshlm config keys
  slow: dict  # slow-tier groups per axis of the mesh as run (after hybrid sharding)
  step_seconds: float
  derivation: str


REFERENCES = {
    "a100": Reference(
        "MPT-7B on 8 A100s, FSDP, no recompute (llm-foundry)",
        "mosaicml/llm-foundry scripts/train/benchmarking/README.md @ b2a43a1, A100 80GB table, row 7b/2048/8",
        MPT_7B, 2048, 96, 8, {"sharding.zero": 3, "grad_accum": 2, "model.remat": "none"}, {},
        96 * 2048 / 37130, "96 x 2048 tokens at 37,130 tokens/s"),
    "h100": Reference(
        "MPT-7B on 8 H100s, FSDP, no recompute (llm-foundry)",
        "mosaicml/llm-foundry scripts/train/benchmarking/README.md @ b2a43a1, H100 80GB BF16 table, row 7b/2048/8",
        MPT_7B, 2048, 48, 8, {"sharding.zero": 3, "model.remat": "none"}, {},
        48 * 2048 / 85144, "48 x 2048 tokens at 85,144 tokens/s"),
    "h200": Reference(
        "Llama 3.1 70B on 256 H200s, 2 replicas of FSDP 128, MLP recomputed (MaxText)",
        "AI-Hypercomputer/gpu-recipes, a3ultra Llama 3.1 70B MaxText recipe @ a3b9cab: 'seconds: 15.516'",
        LLAMA3_70B, 8192, 512, 256, {"sharding.zero": 3, "sharding.fsdp_group": 128, "model.remat": "full"},
        {DATA: 2, EXPERT: 16}, 15.516, "the log's step time; FSDP 128 spans 16 nodes of 8"),
    "b200": Reference(
        "Llama 3 8B on 8 B200s in fp8, data parallel, no recompute (NeMo 25.02)",
        "NeMo Framework docs, Performance Summary, NeMo 25.02, DGX-B200, row LLAMA3-8B/8/128/2/8192",
        LLAMA3_8B, 8192, 128, 8, {"sharding.zero": 1, "grad_accum": 8, "model.remat": "none",
                                  "precision.compute": "float8"}, {},
        128 * 8192 / (26006 * 8), "128 x 8192 tokens at 26,006 tokens/s per GPU; no dense bf16 run is published, "
        "so B200's bf16 steps use the fraction of this fp8 run"),
    "tpu_v4": Reference(
        "MaxText 22B on 64 v4 chips, FSDP 64, full recompute",
        "AI-Hypercomputer/maxtext README.md @ 281e04bf3: 22B on v4-128, 156 TFLOP/s per chip (6N per token)",
        MAXTEXT_22B, 1024, 16 * 64, 64, {"sharding.zero": 3, "model.remat": "full"}, {},
        6 * 22.3e9 * 16 * 1024 / 156e12, "6N FLOPs per token (N = 22.3e9, its count without attention) for 16 x "
        "1,024 tokens per chip at 156 TFLOP/s"),
    "tpu_v5e": Reference(
        "MaxText 16B on 256 v5e chips, FSDP 256, full recompute",
        "AI-Hypercomputer/maxtext README.md @ 9bc243c95 (largest_job/16b.sh): 16B on v5e-256, 120 TFLOP/s per chip",
        MAXTEXT_16B, 2048, 6 * 256, 256, {"sharding.zero": 3, "model.remat": "full"}, {},
        (6 * 16.27e9 + 12 * 32 * 5120 * 2048) * 6 * 2048 / 120e12,
        "its FLOPs per token (6N + 12 x layers x width x length, N = 16.27e9) for 6 x 2,048 tokens per chip at "
        "120 TFLOP/s"),
    "tpu_v5p": Reference(
        "Llama 3.1 405B on 512 v5p chips, FSDP 512, attention's output offloaded, the rest recomputed (MaxText)",
        "AI-Hypercomputer/tpu-recipes training/v5p/Llama3.1-405B-MaxText, MaxText @ 3eb77db: 'seconds: 131.474'",
        # The run's remat is MaxText's "custom" policy (maxtext @ 3eb77db, benchmarks/maxtext_v5p_model_configs.py,
        # llama3_1_405b_8192_v5p_1024: "context": "offload", "mlpwo": "offload"; every other name defaults to
        # "remat" in src/MaxText/configs/base.yml): attention's output kept in host memory, the rest recomputed
        # (the MLP's output buys no recompute: the residual add's backward needs none). meshlm's "offload" is
        # that policy; its host copies have no TPU link figure in step_time and hide under the passes there,
        # so the run is priced as save_attention, the same recompute kept on the device.
        # Its num_vocab_tiling 4 is the config's loss_chunk: 2 x 8,192 tokens per chip in chunks of 4,096.
        LLAMA3_405B, 8192, 1024, 512, {"sharding.zero": 3, "model.remat": "save_attention"}, {},
        131.474, "the log's step time"),
    "tpu_v6e": Reference(
        "Llama 3.1 70B on 256 v6e chips, FSDP 256, recompute with offload (MaxText)",
        "AI-Hypercomputer/tpu-recipes training/trillium/Llama3.1-70B-MaxText/v6e-256, tag tpu-recipes-v0.1.4: "
        "'seconds: 42.656'",
        LLAMA3_70B, 8192, 1280, 256, {"sharding.zero": 3, "model.remat": "full"}, {},
        42.656, "the log's step time"),
}


def reference_config(reference: Reference):
  """The reference run as a meshlm config: its model, batch and layout, all devices on `data`."""
  family, layers, heads, kv_heads, width, mlp, vocab = reference.shape
  c = base()
  c.model.family, c.model.num_layers, c.model.num_heads, c.model.kv_heads = family, layers, heads, kv_heads
  c.model.embed_dim, c.model.mlp_dim, c.model.vocab_size, c.model.max_len = width, mlp, vocab, reference.seq_len
  c.batch_size, c.mesh.data = reference.batch, reference.devices
  return set_fields(c, reference.flags)


def predicted_step(reference: Reference, achievable: float, weights=None) -> float:
  """step_time's prediction of the reference run at `achievable`."""
  from measure.dry_run import model_weights  # the model's abstract: only when asked for
  config = reference_config(reference)
  weights = weights if weights is not None else model_weights(config)
  mesh = hybrid_shape(mesh_shape(config.mesh, reference.devices), config.sharding.fsdp_group)
  cluster = hardware.cluster(_kind_of(reference), reference.devices)
  return step_time.predict(config, mesh, reference.slow, cluster, weights, achievable).step


@functools.cache
def achievable_fraction(kind: str) -> float:
  """The fraction at which step_time predicts the kind's reference run's measured step (to 1e-4 of the
  range searched, 0.01 to 1)."""
  if kind not in REFERENCES:
    raise ValueError(f"device kind {kind!r} has no calibration run; give one of {', '.join(REFERENCES)}.")
  from measure.dry_run import model_weights
  reference = REFERENCES[kind]
  weights = model_weights(reference_config(reference))
  fraction = solve(lambda f: predicted_step(reference, f, weights), reference.step_seconds)
  if fraction is None:
    raise ValueError(f"{reference.label} ran faster than step_time predicts at the full peak; its model of "
                     f"that run is wrong, so {kind} has no calibration.")
  return fraction


def solve(step_at, measured: float, low: float = 0.01, high: float = 1.0) -> float | None:
  """The x in [low, high] at which `step_at(x)` is `measured` seconds, by bisection to 1e-4 of the range
  (`step_at` monotonic either way); None if `measured` lies beyond both ends' steps."""
  at_low, at_high = step_at(low), step_at(high)
  if not min(at_low, at_high) <= measured <= max(at_low, at_high):
    return None
  rising = at_high > at_low
  tolerance = (high - low) * 1e-4
  while high - low > tolerance:
    middle = (low + high) / 2
    if (step_at(middle) > measured) == rising:
      high = middle
    else:
      low = middle
  return (low + high) / 2


def _kind_of(reference: Reference) -> str:
  return next(kind for kind, r in REFERENCES.items() if r is reference)
