"""The peer scripts (`--peers DIR`): a torch.compile GPT-2 and a plain-JAX GPT-2, run beside tools/bench.py.

Each takes `SIZE:BATCH` arguments and prints one JSON line per size with
`tok_s`, `mfu_989`, `step_s`, `seq`, `peak_mem_gib`; sequence 1024 on a GPU
(64 on a CPU, where they exist only to exercise this path). A peer that cannot
run here (no torch on a CPU machine) is reported as unavailable, with why.

A peer runs beside a config only at the peer's shape: GPT-2's layers, heads
and width with GPT-2's vocabulary. meshlm's `tiny` is byte-level (256 tokens),
so `configs/gpt2.py:tiny,model.vocab_size=50257` is the one a peer's tiny
matches; on a CPU also pass `--seq_len=64`, the peers' length there.
"""

import json
import os
import subprocess
import sys

from configs import gpt2

SCRIPTS = {"torch.compile": "torch_gpt2.py", "plain-jax": "jax_gpt2.py"}
# The peers' sizes are GPT-2's, named as in configs/gpt2.py: (layers, heads, width), each with GPT-2's
# BPE vocabulary (padded to 50,304 rows, as meshlm pads it).
SHAPES = {"tiny": (2, 4, 128), **gpt2.SIZES}
VOCAB = 50257


def peer_size(model) -> str | None:
  """The peers' name for this model's shape, or None when no peer runs it (see why_no_peer)."""
  if model.family != "gpt2" or model.vocab_size != VOCAB:
    return None
  shape = (model.num_layers, model.num_heads, model.embed_dim)
  return next((name for name, s in SHAPES.items() if s == shape), None)


def why_no_peer(model) -> str:
  """Why no peer runs this model's shape, in one line; empty when one does."""
  if peer_size(model):
    return ""
  sizes = ", ".join(f"{name} {layers}x{heads}x{width}" for name, (layers, heads, width) in SHAPES.items())
  return (f"no peer runs this shape: {model.family}, {model.num_layers} layers x {model.num_heads} heads x "
          f"{model.embed_dim} wide, vocabulary {model.vocab_size:,}; the peers run GPT-2 ({sizes}) with "
          f"vocabulary {VOCAB:,}")


def run_peer(directory: str, peer: str, size: str, batch: int, *, timeout_s: float, env: dict) -> dict:
  """One peer at one size and batch, in its own process; a record with `tokens_per_s` or `unavailable`."""
  record = {"peer": peer, "size": size, "batch": batch}
  script = os.path.join(directory, SCRIPTS[peer])
  if not os.path.isfile(script):
    return {**record, "unavailable": f"{script} does not exist"}
  try:
    result = subprocess.run([sys.executable, script, f"{size}:{batch}"], capture_output=True, text=True,
                            timeout=timeout_s, env=env)
  except subprocess.TimeoutExpired:
    return {**record, "unavailable": f"timed out after {timeout_s:.0f} s"}
  lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
  if not lines:
    why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}, no output"])[-1]
    return {**record, "unavailable": why[:300]}
  printed = json.loads(lines[-1])
  if "error" in printed:
    return {**record, "unavailable": printed["error"]}
  return {**record, "tokens_per_s": float(printed["tok_s"]), "mfu": printed.get("mfu_989"),
          "step_s": printed.get("step_s"), "seq": printed.get("seq"), "params": printed.get("params"),
          "peak_mem_gib": printed.get("peak_mem_gib"), "compile_s": printed.get("warm_s")}
