"""docs/planning.md's tables of the planner beside published runs (tools/planning_tables.py prints and writes them).

Megatron-LM (Narayanan et al. 2021, Table 1; configs/megatron.py): for each
row, step_time's prediction for the paper's own mesh (tensor x pipeline x
data, ZeRO off and full recomputation as the paper ran, the schedule and
micro-batches it does not state chosen by the planner) as TFLOP/s per GPU
the way the paper counts them (its equation 3 over the predicted step),
beside what it measured; and the planner's own best layout on the same GPUs,
with the paper's mesh's rank among the planner's choices.

Llama 3 70B on TPU v5p ("How to Scale Your Model", Austin et al. 2025, "Training
LLaMA 3 on TPUs"): the book's layout (1,024-way data x 2-way sequence x 4-way
tensor, FSDP, over 8,192 chips as one ICI domain, 1,024 sequences of 4,096
tokens) predicted, beside the book's own estimate (40% MFU, assumed) and the
planner's best.

Measured rows (`check_records`, and `tools/plan.py --check`): each tools/bench.py
record's config built as it ran (measure/bench_runs.py), predicted on its device
kind at the kind's calibrated fraction, beside what the record measured.
"""

import dataclasses
import json
from pathlib import Path

from configs import llama, megatron
from configs.load import set_fields
from measure import bench_runs, calibration, estimate, hardware, planner, step_time
from measure.dry_run import model_weights
from parallel.mesh import hybrid_shape, mesh_shape, slow_tier_shape

RANKED = 10  # the planner's choices searched for the paper's mesh

# The book's figures: 15T tokens, 6 x 70e9 FLOPs per token, 8,960 chips at 4.59e14 and an assumed 40% MFU.
BOOK_TOKENS, BOOK_MFU, BOOK_CHIPS, BOOK_DAYS = 15e12, 0.40, 8960, 44
DAY = 86400


def paper_mesh(row: megatron.Row) -> dict:
  return {"mesh.tensor": row.tensor, "mesh.pipeline": row.pipeline, "mesh.data": row.gpus // (row.tensor * row.pipeline),
          "mesh.sequence": 1, "mesh.expert": 1}


def megatron_row(name: str, achievable: float) -> dict:
  """The paper's mesh predicted (its settings chosen by the planner) and the planner's best, for one row."""
  row = megatron.ROWS[name]
  config = set_fields(megatron.get_config(name), {"precision.compute": "bfloat16"})
  cluster = hardware.cluster("a100", row.gpus)
  weights = model_weights(config)
  as_paper = {**paper_mesh(row), "sharding.zero": 0, "model.remat": "full"}
  theirs = planner.search(config, cluster, weights, achievable, top=1, fixed=as_paper).ranked
  ours = planner.search(config, cluster, weights, achievable, top=RANKED).ranked
  paper = theirs[0] if theirs else None
  rank = next((i for i, c in enumerate(ours, 1) if all(c.axes[key.split(".")[1]] == value
                                                       for key, value in paper_mesh(row).items())), None)
  step_at = lambda slowdown: step_time.predict(planner.configured(config, paper.flags), paper.mesh, paper.slow,
                                               cluster, weights, achievable, slowdown).step
  return {"row": row, "paper": paper, "best": ours[0] if ours else None, "rank": rank, "step_at": step_at}


def teraflops(row: megatron.Row, step: float) -> float:
  """TFLOP/s per GPU as the paper counts them (its equation 3) for a step of `step` seconds."""
  return megatron.paper_flops(row) / (row.gpus * step) / 1e12


def reason(best, paper) -> str:
  """What the planner gives for preferring its own layout: the parts of the step that differ most."""
  b, p = best.time, paper.time
  parts = {"bubble": (b.bubble, p.bubble), "exposed communication": (sum(b.exposed.values()), sum(p.exposed.values())),
           "compute (recomputation)": (b.compute, p.compute)}
  gains = sorted(((theirs - ours, what, ours, theirs) for what, (ours, theirs) in parts.items()), reverse=True)
  return "; ".join(f"{what} {ours:.2f} s against {theirs:.2f} s" for gain, what, ours, theirs in gains if gain > 0.005)


def megatron_table(names: list[str]) -> str:
  """Each row predicted at the A100's calibrated fraction with fused attention (step_time's default), and
  with attention as slow as it fits the paper's first row: Megatron-LM's 2021 attention was not fused,
  and what one slowdown does to the other rows tests the communication and bubble model."""
  achievable = calibration.achievable_fraction("a100")
  rows = [megatron_row(name, achievable) for name in names]
  first = rows[0]
  measured_step = megatron.paper_flops(first["row"]) / (first["row"].gpus * first["row"].teraflops_per_gpu * 1e12)
  slowdown = calibration.solve(first["step_at"], measured_step, low=1.0, high=50.0)
  lines = ["| row | paper's tensor x pipeline x data: settings chosen | measured TFLOP/s per GPU "
           "| predicted, fused attention | / measured "
           f"| predicted, attention {slowdown:.1f}x slower | / measured "
           "| planner's best layout | its TFLOP/s | paper's mesh's rank | why the planner prefers its own |",
           "|" + " --- |" * 11]
  within = {1.0: 0, slowdown: 0}
  for name, r in zip(names, rows):
    row, paper, best, rank = r["row"], r["paper"], r["best"], r["rank"]
    mesh = f"{row.tensor} x {row.pipeline} x {row.gpus // (row.tensor * row.pipeline)}"
    if paper is None:
      lines.append(f"| {name} | {mesh}: does not fit | {row.teraflops_per_gpu:.0f} | | | | | | | | |")
      continue
    predicted = {s: teraflops(row, r["step_at"](s)) for s in within}
    for s, value in predicted.items():
      within[s] += abs(value / row.teraflops_per_gpu - 1) <= 0.15
    lines.append(f"| {name} | {mesh}: {paper.settings or 'defaults'} | {row.teraflops_per_gpu:.0f} "
                 + "".join(f"| {value:.0f} | {value / row.teraflops_per_gpu:.2f} " for value in predicted.values())
                 + f"| {planner.describe_mesh(best.axes, best.slow)}: {best.settings} "
                 f"| {teraflops(row, best.time.step):.0f} | {rank if rank else f'> {RANKED}'} "
                 f"| {'' if rank == 1 else reason(best, paper)} |")
  lines += ["", f"A100 achievable fraction {achievable:.3f} ({calibration.REFERENCES['a100'].label}). Within 15% "
            f"of the measured TFLOP/s: {within[1.0]} of {len(rows)} rows with fused attention; {within[slowdown]} of "
            f"{len(rows)} with attention {slowdown:.1f}x slower than the matmuls, the slowdown that fits row "
            f"{names[0]} (so the other {len(rows) - 1} rows are the check)."]
  return "\n".join(lines)


def llama_table() -> str:
  config = set_fields(llama.get_config("70b"), {"batch_size": 1024, "model.max_len": 4096,
                                               "precision.compute": "bfloat16"})
  cluster = hardware.cluster("tpu_v5p", 8192, fast_group=8192)
  weights = model_weights(config)
  achievable = calibration.achievable_fraction("tpu_v5p")
  book_layout = {"mesh.data": 1024, "mesh.sequence": 2, "mesh.tensor": 4, "mesh.pipeline": 1, "mesh.expert": 1,
                 "sharding.zero": 3, "sharding.fsdp_group": 0}
  book = planner.search(config, cluster, weights, achievable, top=1, fixed=book_layout).ranked
  best = planner.search(config, cluster, weights, achievable, top=1).ranked
  tokens = config.batch_size * config.model.max_len
  days = lambda choice: BOOK_TOKENS / choice.time.tokens_per_second / DAY
  book_step = tokens * 6 * 70e9 / (BOOK_CHIPS * cluster.kind.bf16_flops * BOOK_MFU)
  lines = ["| what | layout | step s | MFU | days for 15T tokens |", "|" + " --- |" * 5,
           f"| the book's estimate | 1,024 data x 2 sequence x 4 tensor, FSDP (8,960 chips in its arithmetic) "
           f"| {book_step:.2f} | {BOOK_MFU:.0%} (assumed) | {BOOK_DAYS} |"]
  for what, found in (("predicted for the book's layout", book), ("the planner's best", best)):
    if found:
      c = found[0]
      lines.append(f"| {what} | {planner.describe_mesh(c.axes, c.slow)}: {c.settings} "
                   f"| {c.time.step:.2f} | {c.time.mfu:.1%} | {days(c):.0f} |")
    else:
      lines.append(f"| {what} | does not fit | | | |")
  lines += ["", f"8,192 v5p chips as one ICI domain, as the book takes them; achievable fraction {achievable:.3f}, "
            f"from {calibration.REFERENCES['tpu_v5p'].label}."]
  return "\n".join(lines)


def calibration_table() -> str:
  lines = ["| kind | calibrated on | measured step s | achievable fraction |", "|" + " --- |" * 4]
  for kind, reference in calibration.REFERENCES.items():
    lines.append(f"| {kind} | {reference.label}; {reference.source} | {reference.step_seconds:.3f} "
                 f"({reference.derivation}) | {calibration.achievable_fraction(kind):.3f} |")
  return "\n".join(lines)


GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Checked:
  """One measured record beside its prediction."""
  label: str  # the record's config spec, overrides and batch
  kind: str
  predicted: step_time.StepTime
  predicted_bytes: int  # the estimator's bytes per device
  measured_step: float
  measured_peak_gib: float
  measured_mfu: float

  @property
  def error(self) -> float:
    """The predicted step over the measured, less one: negative where the planner is optimistic."""
    return self.predicted.step / self.measured_step - 1


def kind_of(device_kind: str, path: str) -> str:
  """measure/hardware.py's kind of a record's jax device_kind ("NVIDIA H200", "TPU v5p")."""
  found = [name for name in hardware.KINDS if name.replace("_", " ") in device_kind.lower()]
  if len(found) != 1:
    raise ValueError(f"{path}: device_kind {device_kind!r} names no one kind of measure/hardware.py; give records "
                     f"measured on one of {', '.join(hardware.KINDS)}.")
  return found[0]


def measured_records(paths: list[str]) -> list[tuple[str, dict]]:
  """The meshlm step measurements of tools/bench.py's JSON lines files (peers and failed runs left out), with
  their file; a file that is missing or holds no such record is refused."""
  found = []
  for path in paths:
    if not Path(path).is_file():
      raise ValueError(f"--check={path} is not a file; give tools/bench.py's JSON lines, e.g. "
                       "benchmarks/h200/2026-12-04-equal.jsonl.")
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith("{")]
    measured = [r for r in records if r.get("kind") == "meshlm" and r.get("step_s")]
    if not measured:
      raise ValueError(f"--check={path} holds no measured meshlm step (tools/bench.py records with step_s); give "
                       "a file tools/bench.py wrote.")
    found += [(path, r) for r in measured]
  return found


def check_record(path: str, record: dict) -> Checked:
  """The record's run as it ran, predicted on its device kind."""
  kind = kind_of(record["device_kind"], path)
  config = bench_runs.build_config(record["config"], [tuple(o) for o in record["overrides"]], batch=record["batch"],
                                   seq_len=record["seq"])
  # The estimator traces the scanned block: unrolled layers (model.scan_layers=false) run the same arithmetic.
  config = set_fields(config, {"model.scan_layers": True})
  mesh = hybrid_shape(mesh_shape(config.mesh, record["devices"]), config.sharding.fsdp_group)
  weights = model_weights(config)
  predicted = step_time.predict(config, mesh, slow_tier_shape(config.mesh, mesh),
                                hardware.cluster(kind, record["devices"]), weights,
                                calibration.achievable_fraction(kind))
  overrides = "".join(f",{key}={value}" for key, value in record["overrides"])
  return Checked(label=f"{record['config']}{overrides}, seq {record['seq']}", kind=kind, predicted=predicted,
                 predicted_bytes=sum(estimate.memory(config, mesh, weights).values()),
                 measured_step=record["step_s"], measured_peak_gib=record["peak_mem_gib"],
                 measured_mfu=record["mfu"])


def check_records(paths: list[str]) -> list[Checked]:
  return [check_record(path, record) for path, record in measured_records(paths)]


def check_table(checked: list[Checked]) -> str:
  """One row per measured record: step, memory and MFU predicted beside measured, and the step's error."""
  lines = ["| run | kind | step ms, predicted / measured | error | memory GiB, predicted / measured "
           "| MFU, predicted / measured | predicted step's parts, ms |", "|" + " --- |" * 7]
  for c in checked:
    t = c.predicted
    parts = ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in t.parts.items() if seconds)
    lines.append(f"| {c.label} | {c.kind} | {t.step * 1e3:.1f} / {c.measured_step * 1e3:.1f} | {c.error:+.0%} "
                 f"| {c.predicted_bytes / GIB:.1f} / {c.measured_peak_gib:.1f} | {t.mfu:.1%} / {c.measured_mfu:.1%} "
                 f"| {parts} |")
  return "\n".join(lines)
