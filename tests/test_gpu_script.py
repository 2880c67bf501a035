"""tools/h200_check.sh's speed stage run whole on the CPU (TINY=1), so that a GPU's minutes are never
spent on a typo; the GPU specs it names; the torch peer's profile and how tools/trace_top.py reads it."""

import gzip
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, SIDECAR, need_sidecar
from measure import bench_runs

TINY = "gpt2:tiny,model.vocab_size=50257"
# A plain-JAX peer that prints the real script's line at the peers' CPU length; a torch peer whose import
# fails, as on a machine without torch.
JAX_PEER = """
    import json, sys
    size, batch = sys.argv[1].split(":")
    print(json.dumps(dict(peer="plain-jax", size=size, params=6835712, batch=int(batch), seq=64,
                          step_s=0.5, tok_s=int(batch) * 64 * 2, mfu_989=0.0, warm_s=1.0, peak_mem_gib=0.5)))
"""
# A torch "peer" with the real one's `run`, uncompiled, so that the profiler's path runs in seconds.
TORCH_PEER = """
    import torch
    def run(size, B, T=1024, steps=10, warm=3, device="cuda"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(B, T, 16)
        for _ in range(warm + steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return dict(peer="torch.compile", size=size, batch=B, seq=T, tok_s=1.0)
"""


def table_rows(stdout: str) -> list[list[str]]:
  """The cells of the last table in `stdout`, the one tools/speed_table.py prints."""
  table = stdout[stdout.rindex("| part | run | result |"):].strip().splitlines()[2:]
  return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table]


@pytest.fixture(scope="module")
def speed_run(tmp_path_factory):
  folder = tmp_path_factory.mktemp("speed")
  shims, peers, out = folder / "bin", folder / "peers", folder / "out"
  shims.mkdir()
  peers.mkdir()
  # The script runs `python3`, the device machine's; here that is this interpreter, with its packages.
  (shims / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
  (shims / "python3").chmod(0o755)
  (peers / "jax_gpt2.py").write_text(textwrap.dedent(JAX_PEER))
  (peers / "torch_gpt2.py").write_text("import torch_is_not_installed_here\n")
  env = {key: value for key, value in os.environ.items() if key not in ("PARTS", "BUDGET_S", "JAX_PLATFORMS")}
  # One CPU device, as one GPU: not the 8 the tests simulate.
  env.update(PATH=f"{shims}:{env['PATH']}", TINY="1", OUT=str(out), PEERS=str(peers),
             XLA_FLAGS="--xla_backend_optimization_level=0")
  result = subprocess.run(["bash", "tools/h200_check.sh", "speed"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stdout, out


def test_speed_stage_runs_every_part_and_prints_its_table_last(speed_run):
  stdout, _ = speed_run
  rows = table_rows(stdout)
  table = "\n".join(" | ".join(row) for row in rows)
  assert stdout.rstrip().endswith(" | ".join(rows[-1]) + " |")
  runs = {(part, run): result for part, run, result in rows}
  # Each switch flipped from whatever its default is when the script runs.
  flips = [f"{TINY},batch_size=2,model.{field}=(true|false)" for field in ("scan_layers", "recompute_activation")]
  names = [f"{TINY},batch_size=2", f"{TINY},batch_size=4", *flips,
           *(f"{TINY},batch_size=2 under {p}" for p in ("cudnn_ln", "lt", "dus0", "dsf", "noremat")),
           "meshlm profile", "torch.compile profile", "llama:tiny,model.remat=full_offload on cpu"]
  assert len(rows) == len(names) and all(re.fullmatch(name, run) for (_, run, _), name in zip(rows, names)), table
  assert [part for part, _, _ in rows] == ["a"] * 2 + ["b"] * 7 + ["c"] * 2 + ["d"], table
  for batch in (2, 4):
    assert re.fullmatch(r"[\d,]+ tokens/s, peak [\d.]+ GiB; torch.compile unavailable; "
                        r"[\d.]+x plain-jax \(its peak 0.50 GiB\)", runs["a", f"{TINY},batch_size={batch}"]), table
  for part, run, result in rows:
    if part == "b":
      assert re.fullmatch(r"[\d,]+ tokens/s, peak [\d.]+ GiB: [\d.]+x \(a\)", result), table
  assert re.fullmatch(r"[\d.]+ ms of kernels per step; largest: .+, [\d.]+ ms", runs["c", "meshlm profile"]), table
  # No torch here: the part fails in one row, and the next part still runs.
  assert runs["c", "torch.compile profile"] == "failed: ModuleNotFoundError: No module named 'torch'", table
  assert re.fullmatch(r"1,024 tokens: compiled [\d.]+ GB against the estimate's [\d.]+ GB and the limit's 0.05 GB; "
                      r"host [\d.]+ GB against [\d.]+ GB", runs["d", "llama:tiny,model.remat=full_offload on cpu"]), table


def test_speed_stage_leaves_few_enough_files_to_come_back(speed_run):
  _, out = speed_run
  # The device tool brings back 8 files from $OUT, two folders deep: traces and dumps stay elsewhere.
  assert sorted(p.name for p in out.iterdir()) == ["bench.jsonl", "card.txt", "commit.txt", "speed.err",
                                                    "speed.log", "versions.txt"]


def test_the_gpu_run_names_configs_and_presets_that_exist():
  # The specs and presets the script and its tools use on the GPU, which TINY=1 replaces: built and checked
  # here, so that a misspelt field or preset is found before a GPU is lent.
  text = (ROOT / "tools" / "h200_check.sh").read_text() + (ROOT / "tools" / "longest_offload.py").read_text()
  specs = set(re.findall(r"configs/\w+\.py:\w+(?:,[\w.]+=\w+)*", text))
  assert {"configs/gpt2.py:124m,batch_size=32", "configs/gpt2.py:1558m,batch_size=16",
          "configs/llama.py:1b,model.remat=full_offload"} <= specs
  for spec in specs:
    bench_runs.build_config(spec, [], batch=None, seq_len=1024)
  presets = {p for found in re.findall(r"--xla_presets=([\w,]+)", text) for p in found.split(",")}
  assert {"cudnn_ln", "lt", "dus0", "dsf", "noremat"} <= presets
  bench_runs.check_presets(sorted(presets))


def test_switched_flips_each_switch_from_its_value_in_the_spec_and_refuses_other_fields():
  spec = "configs/gpt2.py:tiny,model.scan_layers=false"
  assert bench_runs.switched(spec, ["model.scan_layers"]) == [f"{spec},model.scan_layers=true"]
  with pytest.raises(ValueError) as refused:
    bench_runs.switched(spec, ["model.remat"])
  assert str(refused.value) == f"model.remat is 'none' in {spec}, not a switch; name a true/false field."


def write_trace(path, events):
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_trace_top_sums_a_torch_gpu_trace_by_library(tmp_path):
  kernels = {"nvjet_hsh_128x256_64x4_2x1_v_bz_TNT": 6000, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": 2000,
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>": 1500,
             "triton_per_fused_native_layer_norm_0": 400, "triton_poi_fused_gelu_1": 300,
             "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": 200}
  events = [{"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": i * 1e4, "dur": us}
            for i, (name, us) in enumerate(kernels.items())]
  events += [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "pid": 0, "tid": 7,
              "ts": 1e5, "dur": 100},
             # Host-side events of the same steps: not device time.
             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 99999},
             {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 0, "dur": 5}]
  write_trace(tmp_path / "trace.json.gz", events)
  result = subprocess.run([sys.executable, "tools/trace_top.py", f"--trace={tmp_path / 'trace.json.gz'}", "--steps=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "5.25 ms of kernels per step over 7 kernel names (GPU kernels, 2 steps)" in result.stdout
  for row in ["| cuBLAS GEMM | 4.00 | 76.2% |", "| flash attention | 0.75 | 14.3% |",
              "| Triton (inductor) | 0.35 | 6.7% |", "| torch's own (ATen) | 0.10 | 1.9% |",
              "| copy (memcpy) | 0.05 | 1.0% |", "| triton_per_fused_native_layer_norm_0 | 0.20 | 3.8% |"]:
    assert row in result.stdout


def test_torch_profile_records_the_steps_after_the_warm_up_and_trace_top_reads_them(tmp_path):
  need_sidecar()
  (tmp_path / "torch_gpt2.py").write_text(textwrap.dedent(TORCH_PEER))
  trace = tmp_path / "trace.json.gz"
  result = subprocess.run([str(SIDECAR), "tools/torch_profile.py", str(tmp_path / "torch_gpt2.py"), "tiny:4",
                           str(trace)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert json.loads(result.stdout.splitlines()[-1])["profiled_steps"] == 3
  with gzip.open(trace, "rt") as f:
    marks = [e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "user_annotation"]
  # Three warm-up steps and one more waited through; each recorded step ends with the optimizer's.
  assert sorted(m for m in marks if m.startswith("ProfilerStep")) == ["ProfilerStep#4", "ProfilerStep#5",
                                                                       "ProfilerStep#6"]
  assert marks.count("Optimizer.step#AdamW.step") == 3
  table = subprocess.run([sys.executable, "tools/trace_top.py", f"--trace={trace}", "--steps=3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
  assert table.returncode == 0, table.stderr
  assert re.search(r"ms of kernels per step over \d+ kernel names \(outermost CPU operators, 3 steps\)", table.stdout)
  assert "| aten::linear |" in table.stdout


@pytest.mark.parametrize("args, says", [
    (["peer.py", "124m"], "usage: python tools/torch_profile.py PEER_SCRIPT SIZE:BATCH TRACE.json[.gz]"),
    (["nowhere/torch_gpt2.py", "124m:32", "t.json.gz"],
     "error: the peer script nowhere/torch_gpt2.py does not exist; tools/h200_prepare.sh copies it into .peers/."),
    (["tools/torch_profile.py", "124m:32", "nowhere/t.json.gz"],
     "error: the folder of nowhere/t.json.gz does not exist; make it first, the trace is written at the end."),
])
def test_torch_profile_refuses_bad_arguments_in_one_line_without_torch(args, says):
  result = subprocess.run([sys.executable, "tools/torch_profile.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 1 and result.stderr.strip() == says


def test_longest_offload_refuses_a_device_without_a_limit_in_one_line():
  result = subprocess.run([sys.executable, "tools/longest_offload.py", "--spec=configs/llama.py:tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: this cpu device reports no memory limit; pass --limit_gb=GB.")
