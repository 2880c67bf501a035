"""measure/benchmark.py: one measurement of the real train step yields every field, with sane values."""

import math

import pytest

from helpers import tiny_config
from measure.benchmark import measure
from training.state import param_count, plan


@pytest.fixture(scope="module")
def record():
  # A CPU has no known peak, so one is given: MFU is then computed, and checkable.
  config = tiny_config(**{"data.source": "synthetic", "batch_size": 8, "peak_tflops": 0.5})
  return config, measure(config, warmup=1, steps=2, windows=2)


def test_measure_reports_every_field(record):
  config, r = record
  assert r["fits"] and r["batch"] == 8 and r["seq"] == config.model.max_len
  assert r["devices"] == 8 and r["mesh"] == {"data": 8}
  assert r["params"] == r["active_params"] == param_count(plan(config))  # dense: every parameter is active
  assert r["compile_s"] > 0 and len(r["window_step_s"]) == 2 and all(s > 0 for s in r["window_step_s"])
  assert min(r["window_step_s"]) <= r["step_s"] <= max(r["window_step_s"])
  assert r["tokens_per_s"] == pytest.approx(8 * config.model.max_len / r["step_s"], rel=1e-3)
  assert 0 < r["peak_mem_gib"] < 1 and r["peak_mem_source"] == "compiled.memory_analysis"
  # Uniform random bytes start near ln 256; the same batch over and over brings it down, never past 0.
  assert 0 < r["loss"] < math.log(256) + 0.5


# conftest's tiny GPT-2 (L = 2 layers, d = 64, MLP f = 256, T = 32, vocabulary V = 256, tied head) by hand:
#   embeddings  V d + T d = 16384 + 2048                                   = 18432
#   per layer   2 LayerNorms 4d = 256, QKV d 3d + 3d = 12480, out d d + d = 4160,
#               up d f + f = 16640, down f d + d = 16448                    = 49984, x 2 layers = 99968
#   final LayerNorm 2d                                                      = 128
TINY_PARAMS = 18432 + 99968 + 128  # = 118528
# 6N + 12 L T d (PaLM, appendix B) = 6 x 118528 + 12 x 2 x 32 x 64 = 711168 + 49152
TINY_FLOPS_PER_TOKEN = 760320


def test_mfu_is_six_n_plus_attention_over_the_peak(record):
  _, r = record
  assert r["params"] == TINY_PARAMS
  expected = r["tokens_per_s"] * TINY_FLOPS_PER_TOKEN / (0.5e12 * 8)  # peak_tflops=0.5 on each of 8 devices
  # mfu is reported to 4 significant digits (relative rounding <= 5e-4) and tokens/s to 0.1.
  assert r["mfu"] == pytest.approx(expected, rel=1e-3)


def test_bad_timing_is_refused_before_compiling():
  with pytest.raises(ValueError, match="steps >= 1"):
    measure(tiny_config(), warmup=1, steps=0, windows=1)
