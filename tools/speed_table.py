"""The short table tools/h200_check.sh's `speed` stage prints last: one row per run of its four parts.

  python tools/speed_table.py --out=$OUT

Reads what the stage left in the folder. bench.jsonl holds tools/bench.py's
records in the order they ran: the first run of each model and batch is part
(a)'s, shown beside the peers of its size and batch, and every later one of
that model and batch is a switch or an XLA preset of part (b), shown as a
ratio to it. It also holds tools/longest_offload.py's record (d) and one line
for each part the stage skipped or that failed. speed.log holds
tools/trace_top.py's tables (c): each one's per-step total and largest row.
"""

import os
import re
from pathlib import Path

from absl import app, flags

from measure.bench_report import read_records

_OUT = flags.DEFINE_string("out", None, "The folder the speed stage wrote (its $OUT).", required=True)

# tools/trace_top.py's first line; its kind of rows says whose trace it read.
_PROFILE = re.compile(r"^\S+: ([\d.]+) ms of kernels per step over \d+ (HLO instructions|kernel names)")
_SIDES = {"HLO instructions": "meshlm", "kernel names": "torch.compile"}


def _short(spec: str) -> str:
  return spec.removeprefix("configs/").replace(".py:", ":")


def _name(record: dict) -> str:
  name = _short(record["config"])
  return name if record.get("preset", "default") == "default" else f"{name} under {record['preset']}"


def _gib(value) -> str:
  return "?" if value is None else f"{value:.2f}"


def _speed(record: dict) -> str:
  if not record.get("tokens_per_s"):
    return record.get("error") or record.get("unavailable") or "no measurement"
  return f"{record['tokens_per_s']:,.0f} tokens/s, peak {_gib(record.get('peak_mem_gib'))} GiB"


def _beside_peers(ours: dict, peers: list[dict]) -> str:
  """Ours, then our tokens/s over each peer's at the same size, batch and sequence."""
  cells = [_speed(ours)]
  for peer in peers:
    if peer["size"] != ours.get("peer_size") or peer["batch"] != ours["batch"]:
      continue
    if not peer.get("tokens_per_s"):
      cells.append(f"{peer['peer']} unavailable")
    elif peer.get("seq") != ours.get("seq") or not ours.get("tokens_per_s"):
      cells.append(f"{peer['peer']} {_speed(peer)}")
    else:
      cells.append(f"{ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x {peer['peer']} "
                   f"(its peak {_gib(peer.get('peak_mem_gib'))} GiB)")
  return "; ".join(cells)


def _against(record: dict, first: dict) -> str:
  if not record.get("tokens_per_s") or not first.get("tokens_per_s"):
    return _speed(record)
  return f"{_speed(record)}: {record['tokens_per_s'] / first['tokens_per_s']:.2f}x (a)"


def _long_context(r: dict) -> str:
  return (f"{r['length']:,} tokens: compiled {r['compiled_gb']} GB against the estimate's {r['estimate_gb']} GB "
          f"and the limit's {r['limit_gb']} GB; host {r['compiled_host_gb']} GB against {r['host_estimate_gb']} GB")


def _profiles(log: str) -> list[tuple[str, str, str]]:
  """(c)'s rows: each trace_top table's per-step total and its first (largest) row."""
  rows, lines = [], log.splitlines()
  for i, line in enumerate(lines):
    if match := _PROFILE.match(line):
      largest = next((cells for cells in (lines[j].split("|") for j in range(i + 1, len(lines)))
                      if len(cells) > 3 and cells[2].strip().replace(".", "").isdigit()), None)
      biggest = f"; largest: {largest[1].strip()}, {largest[2].strip()} ms" if largest else ""
      rows.append(("c", f"{_SIDES[match.group(2)]} profile", f"{match.group(1)} ms of kernels per step{biggest}"))
  return rows


def rows(records: list[dict], log: str) -> list[tuple[str, str, str]]:
  """(part, run, result) for every run, in the order of the parts, then of the runs."""
  peers = [r for r in records if r.get("kind") == "peer"]
  firsts, out = {}, []
  for r in records:
    kind = r.get("kind")
    if kind == "meshlm":
      key = (r["config"].split(",")[0], r["batch"], r.get("seq"))
      if key in firsts:
        out.append(("b", _name(r), _against(r, firsts[key])))
      else:
        firsts[key] = r
        out.append(("a", _name(r), _beside_peers(r, peers)))
    elif kind == "long_context":
      out.append(("d", f"{_short(r['spec'])} on {r['device_kind']}", _long_context(r)))
    elif kind in ("skipped", "failed"):
      out.append((r["part"], r["what"], f"{kind}: {r['why']}"))
  return sorted(_profiles(log) + out, key=lambda row: row[0])  # stable: runs keep their order


def main(argv):
  del argv
  bench, log = os.path.join(_OUT.value, "bench.jsonl"), os.path.join(_OUT.value, "speed.log")
  records = read_records(bench) if os.path.exists(bench) else []
  lines = ["| part | run | result |", "| --- | --- | --- |"]
  lines += [f"| {part} | {run} | {result} |"
            for part, run, result in rows(records, Path(log).read_text() if os.path.exists(log) else "")]
  print("Speed run: (a) equal, (b) one change at a time, (c) profiles, (d) longest full_offload context\n")
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
