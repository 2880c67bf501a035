"""Markdown tables from tools/bench.py's JSON lines: equal batch with ratios, best batch, peers, CPU layouts.

Works on records alone, so `tools/bench.py --report FILE` redraws the tables of
an earlier run (the device check writes its records to a file).
"""

import json


def read_records(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip().startswith("{")]


def tables(records: list[dict]) -> str:
  """Every table the records support, each under a heading."""
  ours = [r for r in records if r.get("kind") == "meshlm" and "layout" not in r]
  layouts = [r for r in records if r.get("kind") == "meshlm" and "layout" in r]
  peers = [r for r in records if r.get("kind") == "peer"]
  parts = [_setting(ours + layouts)] if ours or layouts else []
  if ours:
    parts += ["### Every run (ratios at equal batch and preset)", _equal_batch(ours, peers)]
    best = _best_batch(ours, peers)
    if best:
      parts += ["### Best batch that fits", best]
  unmatched = _unmatched(ours)
  if peers or unmatched:
    parts += ["### Peers (ratios only where a peer ran the same shape: sequence, parameters within 5%)",
              *filter(None, [_peers(peers) if peers else "", unmatched])]
  if layouts:
    parts += ["### Parallel layouts (step time / single-device step time)", _layouts(layouts)]
  return "\n\n".join(parts)


def _setting(records: list[dict]) -> str:
  """Where the numbers come from: device, backend, jax, timing, XLA flags."""
  r = records[0]
  flags = sorted({x.get("xla_flags", "") for x in records} - {""})
  return (f"{r.get('device_kind', '?')} ({r.get('backend', '?')}), jax {r.get('jax', '?')}; median of "
          f"{r.get('windows')} windows of {r.get('steps')} steps after {r.get('warmup')} warm-up steps"
          + (f"; XLA_FLAGS: {' | '.join(flags)}" if flags else ""))


def _row(cells) -> str:
  return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header, rows) -> str:
  return "\n".join([_row(header), _row(["---"] * len(header)), *map(_row, rows)])


def _num(value, fmt: str) -> str:
  return "" if value is None else format(value, fmt)


def _ratio(ours: dict, other: dict | None) -> str:
  if not other or not ours.get("tokens_per_s") or not other.get("tokens_per_s"):
    return ""
  return f"{ours['tokens_per_s'] / other['tokens_per_s']:.2f}x"


def _shape_difference(ours: dict, peer: dict) -> str:
  """What the peer ran that ours did not (sequence, parameter count); empty when the shapes are equal."""
  if peer.get("seq") != ours.get("seq"):
    return f"seq {peer.get('seq')} (ours {ours.get('seq')})"
  theirs, mine = peer.get("params") or 0, ours.get("params") or 0
  # The peers leave position embeddings out of their count: a few percent apart is the same model.
  if not theirs or not mine or abs(theirs / mine - 1) > 0.05:
    return f"{theirs / 1e6:.1f}M params (ours {mine / 1e6:.1f}M)"
  return ""


def _peer_ratio(ours: dict, peer: dict | None) -> str:
  """Our tokens/s over the peer's where both ran the same shape; otherwise why there is no ratio."""
  if ours.get("no_peer"):
    return "no peer of this shape"
  difference = _shape_difference(ours, peer) if peer and ours.get("tokens_per_s") else ""
  return f"no ratio: peer ran {difference}" if difference else _ratio(ours, peer)


def _peer_for(peers: list[dict], name: str, size: str | None, batch: int) -> dict | None:
  return next((p for p in peers if p["peer"] == name and p["size"] == size and p["batch"] == batch
               and p.get("tokens_per_s")), None)


def _peer_names(peers: list[dict]) -> list[str]:
  return sorted({p["peer"] for p in peers}, reverse=True)  # torch.compile first


def _failed(r: dict) -> str:
  return f"error: {r['error']}" if r.get("error") else "no result"


def _result_cells(r: dict) -> list[str]:
  if not r.get("tokens_per_s"):
    return [_failed(r)] + [""] * 5
  mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
  return [f"{r['tokens_per_s']:,.0f}", mfu, _num(1e3 * r["step_s"], ".1f"), _num(r.get("peak_mem_gib"), ".2f"),
          _num(r.get("compile_s"), ".1f"), f"{r['compute']}/{r['attention']}"]


def _equal_batch(ours: list[dict], peers: list[dict]) -> str:
  names = _peer_names(peers)
  first_config = ours[0]["config"]
  header = ["config", "batch", "seq", "XLA preset", "tokens/s", "MFU", "step ms", "peak GiB", "compile s",
            "compute/attention", f"vs {first_config}"] + [f"vs {n}" for n in names]
  rows = []
  for r in ours:
    first = next((f for f in ours if f["config"] == first_config and f["batch"] == r["batch"]
                  and f["preset"] == r["preset"]), None)
    rows.append([r["config"], r["batch"], r.get("seq", ""), r["preset"], *_result_cells(r), _ratio(r, first)]
                + [_peer_ratio(r, _peer_for(peers, n, r.get("peer_size"), r["batch"])) for n in names])
  return _table(header, rows)


def _best(records: list[dict]) -> dict | None:
  fitting = [r for r in records if r.get("tokens_per_s")]
  return max(fitting, key=lambda r: r["tokens_per_s"]) if fitting else None


def _best_batch(ours: list[dict], peers: list[dict]) -> str:
  """One row per (config, preset) whose batches were searched: the batch with the most tokens/s."""
  names = _peer_names(peers)
  groups = {}
  for r in ours:
    groups.setdefault((r["config"], r["preset"]), []).append(r)
  rows = []
  for (config, preset), group in groups.items():
    best = _best(group)
    if len(group) < 2 or best is None:
      continue
    tried = ", ".join(str(r["batch"]) for r in group) + ("" if group[-1].get("tokens_per_s") else " (last failed)")
    peer_best = [_best([p for p in peers if p["peer"] == n and p["size"] == best.get("peer_size")]) for n in names]
    rows.append([config, preset, tried, best["batch"], f"{best['tokens_per_s']:,.0f}",
                 "" if best.get("mfu") is None else f"{100 * best['mfu']:.1f}%",
                 _num(best.get("peak_mem_gib"), ".2f")]
                + [f"{_peer_ratio(best, p)} (at {p['batch']})" if p else "" for p in peer_best])
  header = ["config", "XLA preset", "batches tried", "best batch", "tokens/s", "MFU", "peak GiB"] + [
      f"vs best {n}" for n in names]
  return _table(header, rows) if rows else ""


def _peers(peers: list[dict]) -> str:
  rows = []
  for p in peers:
    if p.get("unavailable"):
      rows.append([p["peer"], p["size"], p["batch"], f"unavailable: {p['unavailable']}", "", "", "", ""])
      continue
    mfu = "" if p.get("mfu") is None else f"{100 * p['mfu']:.1f}%"
    rows.append([p["peer"], p["size"], p["batch"], f"{p['tokens_per_s']:,.0f}", mfu,
                 _num(1e3 * p["step_s"], ".1f") if p.get("step_s") else "", p.get("seq", ""),
                 _num(p.get("peak_mem_gib"), ".1f")])
  return _table(["peer", "size", "batch", "tokens/s", "MFU (989 TF/s)", "step ms", "seq", "peak GiB"], rows)


def _unmatched(ours: list[dict]) -> str:
  """One line per config that no peer could run, saying why."""
  reasons = {r["config"]: r["no_peer"] for r in ours if r.get("no_peer")}
  return "\n".join(f"- {config}: {why}" for config, why in reasons.items())


def _layouts(layouts: list[dict]) -> str:
  rows = []
  for r in layouts:
    single = next((s for s in layouts if s["group"] == r["group"] and s["devices"] == 1 and s.get("step_s")), None)
    if not r.get("tokens_per_s"):
      rows.append([r["group"], r["layout"], r.get("devices", ""), _failed(r), "", "", ""])
      continue
    ratio = f"{r['step_s'] / single['step_s']:.2f}" if single else ""
    rows.append([r["group"], r["layout"], r["devices"], _num(1e3 * r["step_s"], ".1f"), ratio,
                 f"{r['tokens_per_s']:,.0f}", _num(r.get("compile_s"), ".1f")])
  return _table(["model", "layout", "devices", "step ms", "ratio to single", "tokens/s", "compile s"], rows)
