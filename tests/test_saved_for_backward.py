"""What one layer keeps for its backward pass (measure/saved_for_backward.py) against figures derived by hand,
and torch.compile's side of tools/saved_vs_torch.py in the transformers sidecar (.venv-hf).

The tiny GPT-2 of helpers.tiny_config: width D = 64, MLP width F = 256, 4 heads of 16, 32 positions. A
D-unit is one bfloat16 vector of the width per token, 128 bytes.
"""

import json
import subprocess
import sys

import pytest

from helpers import ROOT, SIDECAR, need_sidecar, tiny_config
from measure import saved_for_backward
from training.state import model_config

D, F = 64, 256
TOOL = ROOT / "tools" / "saved_vs_torch.py"


def budget(**overrides):
  return saved_for_backward.budget(model_config(tiny_config(**overrides)), backend="cpu")


def units(b, file: str, code: str = "") -> list[float]:
  """The D-units of each row made in `file` by a line holding `code`."""
  return [b.units(s.total) for s in b.saved if s.source.startswith(file) and code in s.source]


# The up projection's output is F values per token: F/D = 4 units in bfloat16, 8 in float32.
@pytest.mark.parametrize("dtype, pre_activation", [("float32", 8), ("bfloat16", 4)])
def test_the_mlp_keeps_its_pre_activation_alone_and_autodiff_tanh_gelus_values_too(dtype, pre_activation):
  # model.recompute_activation (the default): the activation and the down projection's input are made again
  # in the backward pass from the pre-activation, the only value of the MLP kept.
  b = budget(**{"precision.compute": dtype})
  assert units(b, "model/mlp.py", "up = up + bias(") == [pre_activation]
  assert units(b, "model/layers.py", "ACTIVATIONS[name](h)") == [] and units(b, "in gelu") == []
  assert all("32" in s.type for s in b.saved)  # every value has the 32 positions: no weight, nor its cast
  # tanh-GELU differentiated as written keeps four more values as wide, its output among them: 4 x F/D units.
  autodiff = budget(**{"precision.compute": dtype, "model.recompute_activation": False})
  assert units(autodiff, "model/mlp.py", "up = up + bias(") == [pre_activation]
  assert sum(units(autodiff, "model/layers.py", "ACTIVATIONS[name](h)")) == 4 * pre_activation
  assert b.units(autodiff.per_layer - b.per_layer) == 4 * pre_activation


@pytest.mark.parametrize("dtype, width_bytes", [("float32", 4), ("bfloat16", 2)])
def test_remat_full_keeps_only_the_block_input(dtype, width_bytes):
  b = budget(**{"precision.compute": dtype, "model.remat": "full"})
  assert [(s.source, s.count, s.bytes) for s in b.saved] == [
      ("the block's input (named 'block_input')", 1, D * width_bytes)]
  assert b.units(b.per_layer) == width_bytes / 2


def test_cudnn_attention_is_counted_by_rule():
  b = budget(**{"precision.compute": "bfloat16", "model.attention": "cudnn"})
  ruled = {s.source: b.units(s.total) for s in b.saved if s.source.endswith("(by rule)")}
  # q, k, v and the output are 4 heads x 16 bfloat16 values per token, one unit each; the log-sum-exp one
  # float32 per head.
  assert ruled == {"cudnn attention's q (by rule)": 1, "cudnn attention's k (by rule)": 1,
                   "cudnn attention's v (by rule)": 1, "cudnn attention's output (by rule)": 1,
                   "cudnn attention's log-sum-exp (by rule)": 4 * 4 / (2 * D)}
  assert not units(b, "model/attention.py")  # nothing of the xla kernel it was traced with
  text = saved_for_backward.format_budget(b, layers=2, tokens=64)
  assert "model.attention=cudnn is traced as the xla kernel" in text and "counted by rule" in text
  # Under a remat policy the kernel's own values are recomputed: the trace stands, with no rule.
  assert not budget(**{"precision.compute": "bfloat16", "model.attention": "cudnn", "model.remat": "full"}).rule


def test_the_step_total_is_per_layer_times_layers_times_tokens():
  b = budget(**{"precision.compute": "bfloat16", "model.remat": "full"})  # 128 bytes per token per layer
  text = saved_for_backward.format_budget(b, layers=4, tokens=2048, temporaries=3 * 2**20, tensor=2)
  assert text.splitlines()[-1] == ("step: 128 bytes x 4 layers x 2,048 tokens per device = 1.0 MiB (the whole "
                                   "layer's values: mesh.tensor=2 splits the heads' and the MLP's), beside the "
                                   "compiled step's temporaries 3.0 MiB")


def test_torch_side_saves_what_inductors_partitioner_keeps():
  need_sidecar()
  job = {"width": D, "heads": 4, "mlp": F, "length": 32, "epsilon": 1e-5, "dtype": "bfloat16"}
  result = subprocess.run([str(SIDECAR), str(TOOL), "--torch_side", json.dumps(job)], capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(result.stdout.splitlines()[-1])["rows"]
  per_token = {(r["source"].split(":")[0], r["type"]): r["bytes"] * r["count"] for r in rows}
  # Under autocast the residual stream stays float32 (2 units); the up projection's bfloat16 output is F/D
  # units, and SDPA's flash kernel keeps its output and a float32 log-sum-exp per head.
  assert per_token[("the block's input", "f32[1,32,64]")] == 4 * D
  assert per_token[("mlp.c_fc addmm", "bf16[32,256]")] == 2 * F
  assert per_token[("attn _scaled_dot_product_flash_attention_for_cpu[0]", "bf16[1,4,32,16]")] == 2 * D
  assert per_token[("attn _scaled_dot_product_flash_attention_for_cpu[1]", "f32[1,4,32]")] == 4 * 4
  assert all("32" in r["type"] for r in rows)  # every tensor has the tokens: no weight, nor its cast


@pytest.mark.parametrize("flags, says", [
    (["--config=configs/llama.py:tiny"], "--config is a llama model; the torch side is transformers' dense "
                                         "GPT2Block: give a dense configs/gpt2.py variant."),
    (["--config=configs/gpt2.py:moe_tiny"], "--config is a gpt2 model with experts;"),
    (["--config=configs/gpt2.py:tiny", "--config.precision.compute=float16"],
     "precision.compute='float16' has no torch peer here; use bfloat16 (torch's autocast) or float32."),
])
def test_tool_refuses_what_has_no_torch_peer_in_one_line(flags, says):
  result = subprocess.run([sys.executable, str(TOOL), *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr
