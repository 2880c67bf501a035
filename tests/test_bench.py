"""tools/bench.py end to end on the tiny model, with peers; its search, specs, presets and layouts."""

import re
import subprocess
import sys
import textwrap
from importlib import metadata

import jax
import pytest

from helpers import ROOT
from measure import bench_report, bench_runs
from training.state import plan


# Peers for a machine without the real ones: a plain-JAX peer that prints the
# real script's JSON line for its tiny GPT-2 (2 x 4 x 128, vocabulary 50,257 padded
# to 50,304, position embeddings not counted; tokens/s fixed, so the ratio is
# checkable) and a torch peer whose import fails, as on a machine without torch.
JAX_PEER = """
    import json, sys
    size, batch = sys.argv[1].split(":")
    print(json.dumps(dict(peer="plain-jax", size=size, params=6835712, batch=int(batch), seq=32,
                          step_s=0.5, tok_s=int(batch) * 32 * 2, mfu_989=0.0, warm_s=1.0, peak_mem_gib=0.0)))
"""
BYTE_TINY, BPE_TINY = "configs/gpt2.py:tiny", "configs/gpt2.py:tiny,model.vocab_size=50257"


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
  folder = tmp_path_factory.mktemp("bench")
  peers = folder / "peers"
  peers.mkdir()
  (peers / "jax_gpt2.py").write_text(textwrap.dedent(JAX_PEER))
  (peers / "torch_gpt2.py").write_text("import torch_is_not_installed_here\n")
  out = folder / "bench.jsonl"
  result = subprocess.run(
      [sys.executable, "tools/bench.py", f"--config={BYTE_TINY}", f"--config={BPE_TINY}",
       "--config.mesh.data=4", "--config.mesh.tensor=2",
       "--batch=8", "--seq_len=32", "--steps=2", "--warmup=1", "--windows=1", f"--peers={peers}", f"--out={out}",
       "--config.profile_steps=1,2", f"--config.workdir={folder / 'work'}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  return result.stdout, bench_report.read_records(out), folder / "work"


def test_json_lines_hold_sane_numbers(cli_run):
  _, records, _ = cli_run
  ours = [r for r in records if r["kind"] == "meshlm"]
  assert [r["config"] for r in ours] == [BYTE_TINY, BPE_TINY]
  for r in ours:
    assert "error" not in r, r
    assert r["batch"] == 8 and r["seq"] == 32 and r["mesh"] == {"data": 4, "tensor": 2}
    assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["compile_s"] > 0 and r["peak_mem_gib"] > 0
    assert r["mfu"] is None  # a CPU's peak is unknown
  assert ours[0]["params"] < 500_000 < 6_800_000 < ours[1]["params"]  # 256 against 50,304 embedding rows
  # The peers' tiny has GPT-2's vocabulary: meshlm's byte-level tiny is not its shape, and the record says so.
  assert ours[0]["peer_size"] is None and "vocabulary 256" in ours[0]["no_peer"]
  assert ours[1]["peer_size"] == "tiny" and "no_peer" not in ours[1]


def equal_batch_cells(stdout: str, config: str) -> dict:
  """The equal-batch table's row for `config`, as {column: cell}."""
  lines = stdout[stdout.index("### Every run"):].splitlines()
  header = next(line for line in lines if line.startswith("| config |"))
  row = next(line for line in lines if line.startswith(f"| {config} |"))
  cells = lambda line: [cell.strip() for cell in line.strip().strip("|").split("|")]
  return dict(zip(cells(header), cells(row)))


def test_peers_ratio_only_at_equal_shapes(cli_run):
  stdout, records, _ = cli_run
  peer = {r["peer"]: r for r in records if r["kind"] == "peer"}
  assert peer["plain-jax"]["tokens_per_s"] == 8 * 32 * 2 and peer["plain-jax"]["size"] == "tiny"
  assert "torch_is_not_installed_here" in peer["torch.compile"]["unavailable"]
  assert "unavailable: ModuleNotFoundError" in stdout
  byte, bpe = (r for r in records if r["kind"] == "meshlm")
  assert equal_batch_cells(stdout, BPE_TINY)["vs plain-jax"] == f"{bpe['tokens_per_s'] / 512:.2f}x"
  # 446K parameters and 256 tokens against the peer's 6.8M and 50,257: the reason, never a ratio.
  byte_cells = equal_batch_cells(stdout, BYTE_TINY)
  assert byte_cells["vs plain-jax"] == "no peer of this shape" and byte_cells[f"vs {BYTE_TINY}"] == "1.00x"
  assert f"- {BYTE_TINY}: {byte['no_peer']}" in stdout


def test_peer_ratio_needs_the_same_sequence_and_parameters():
  ours = {"kind": "meshlm", "config": "c", "batch": 8, "seq": 64, "preset": "default", "peer_size": "tiny",
          "params": 6_840_000, "tokens_per_s": 900.0, "step_s": 1.0, "compute": "float32", "attention": "xla"}
  peer = {"kind": "peer", "peer": "plain-jax", "size": "tiny", "batch": 8, "seq": 64, "params": 6_835_712,
          "tokens_per_s": 300.0, "step_s": 1.0}
  assert equal_batch_cells(bench_report.tables([ours, peer]), "c")["vs plain-jax"] == "3.00x"
  for changed, why in [({"seq": 1024}, "seq 1024 (ours 64)"), ({"params": 124_000_000}, "124.0M params")]:
    cell = equal_batch_cells(bench_report.tables([ours, {**peer, **changed}]), "c")["vs plain-jax"]
    assert cell == f"no ratio: peer ran {why}" or cell.startswith(f"no ratio: peer ran {why} "), cell


def test_report_redraws_the_tables(cli_run):
  stdout, records, _ = cli_run
  assert stdout.rstrip().endswith(bench_report.tables(records))


def test_profile_steps_trace_an_extra_window(cli_run):
  *_, workdir = cli_run
  traces = list((workdir / "profile").glob("plugins/profile/*/*.xplane.pb"))
  assert traces, "no trace written"


def test_best_batch_search_doubles_until_a_failure():
  assert bench_runs.batch_sizes(16, True, 100) == [16, 32, 64]
  assert bench_runs.batch_sizes(16, False, 100) == [16]
  fits = lambda b: {"batch": b, "tokens_per_s": 10.0 * b} if b <= 32 else {"batch": b, "fits": False}
  assert [r["batch"] for r in bench_runs.searched(fits, [8, 16, 32, 64, 128])] == [8, 16, 32, 64]
  records = [{"kind": "meshlm", "config": "c", "preset": "default", **r, "step_s": 1.0, "compute": "bfloat16",
              "attention": "xla"} for r in bench_runs.searched(fits, [8, 16, 32, 64])]
  table = bench_report.tables(records)
  assert "| c | default | 8, 16, 32, 64 (last failed) | 32 | 320 |" in table


def test_config_specs_and_overrides():
  config = bench_runs.build_config("configs/gpt2.py:tiny,model.num_layers=3,model.remat=full",
                                   [("sharding.zero", "3"), ("optimizer.decay_1d", "true")], batch=4, seq_len=64)
  assert (config.model.num_layers, config.model.remat, config.sharding.zero) == (3, "full", 3)
  assert config.optimizer.decay_1d is True and config.batch_size == 4 and config.model.max_len == 64
  assert config.data.source == "synthetic"
  with pytest.raises(ValueError, match="no field 'model.layerz'"):
    bench_runs.build_config("configs/gpt2.py:tiny,model.layerz=3", [], batch=None, seq_len=64)
  with pytest.raises(ValueError, match="not a number"):
    bench_runs.build_config("configs/gpt2.py:tiny", [("batch_size", "many")], batch=None, seq_len=64)
  assert bench_runs.split_overrides(["--batch=2", "--config.mesh.data=4"]) == (["--batch=2"], [("mesh.data", "4")])


def test_xla_presets_are_flags_this_jaxlib_knows():
  # XLA aborts at start-up on an unknown flag, GPU flags included even on a CPU, and names each one.
  flags = sorted({f for preset in bench_runs.XLA_PRESETS.values() for f in preset})
  assert bench_runs.unknown_xla_flags(flags) == []
  assert bench_runs.unknown_xla_flags(["--xla_gpu_enable_cublaslt=true", "--xla_gpu_made_up=1"]) == [
      "--xla_gpu_made_up=1"]


def test_a_preset_with_a_flag_jaxlib_lacks_is_refused_in_one_line(monkeypatch):
  monkeypatch.setitem(bench_runs.XLA_PRESETS, "made_up", ["--xla_gpu_enable_cublaslt=true", "--xla_gpu_made_up=1"])
  with pytest.raises(ValueError) as refused:
    bench_runs.check_presets(["default", "lt", "made_up"])
  assert str(refused.value) == (f"XLA preset 'made_up' needs --xla_gpu_made_up=1, which the installed jaxlib "
                                f"{metadata.version('jaxlib')} does not know; leave made_up out of --xla_presets.")


@pytest.mark.parametrize("layout", bench_runs.CPU_LAYOUTS, ids=lambda layout: f"{layout[0]}: {layout[1]}")
def test_cpu_layouts_plan_as_their_labels_say(layout):
  _, label, spec, overrides, devices = layout
  config = bench_runs.build_config(spec, [(k, str(v)) for k, v in overrides.items()], batch=32, seq_len=128)
  planned = plan(config, jax.devices()[:devices])
  # The table's rows are read by their labels: "data=4 x tensor=2" must be the mesh the plan built.
  labelled = {axis: int(size) for axis, size in re.findall(r"(\w+)=(\d+)", label) if axis in planned.mesh.shape}
  assert dict(planned.mesh.shape) == {axis: labelled.get(axis, 1) for axis in planned.mesh.shape}
  assert planned.schedule == (re.search(r"gpipe|1f1b|interleaved", label) or ["none"])[0]


@pytest.mark.parametrize("args, says", [
    (["--batch=0"], "error: --batch=0 must be positive integers"),
    (["--steps=0"], "error: flag --steps=0: 0 is not a positive integer"),
    (["--xla_presets=default,nope"], "error: unknown XLA preset(s) ['nope']; choose from default, lhs,"),
])
def test_bad_flags_are_one_line_before_anything_runs(args, says):
  result = subprocess.run([sys.executable, "tools/bench.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
  message = result.stderr.strip()
  assert result.returncode == 1 and message.startswith(says) and "\n" not in message, message
