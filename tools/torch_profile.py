"""The torch.compile peer's training step under torch.profiler: a chrome trace that tools/trace_top.py sums.

  python tools/torch_profile.py .peers/torch_gpt2.py 124m:32 runs/torch_trace.json.gz
  python tools/trace_top.py --trace=runs/torch_trace.json.gz --steps=3

Runs the peer's own `run` (its model, torch.compile, bf16 autocast, fused
AdamW, its warm-up steps): the profiler waits through the warm-up and one
timed step, then records STEPS steps, each ended by the optimizer's step, and
writes them as a chrome trace (gzipped when the name ends in .gz). Prints the
peer's JSON line, whose timings the profiler has slowed: tools/bench.py's
peer runs are the measurement. Needs torch, not jax nor absl, so that any
Python with torch runs it (the tests use the transformers sidecar).
"""

import importlib.util
import json
import os
import sys

WARM, STEPS = 3, 3  # the peer's warm-up steps (its compile), then the recorded steps


def main(peer_script: str, size_batch: str, trace: str) -> None:
  import torch  # pylint: disable=import-outside-toplevel  # here, so that bad arguments are refused without it
  from torch.optim.optimizer import register_optimizer_step_post_hook  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("torch_peer", peer_script)
  peer = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(peer)
  size, batch = size_batch.split(":")
  cuda = torch.cuda.is_available()
  torch.backends.cuda.matmul.allow_tf32 = True  # as the peer's own command line sets it
  activities = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]
  schedule = torch.profiler.schedule(wait=WARM, warmup=1, active=STEPS, repeat=1)
  with torch.profiler.profile(activities=activities, schedule=schedule,
                              on_trace_ready=lambda done: done.export_chrome_trace(trace)) as profiler:

    def step_ended(*_):
      if cuda:
        torch.cuda.synchronize()  # the step's kernels land in its own profiler step
      profiler.step()

    hook = register_optimizer_step_post_hook(step_ended)
    try:
      # The peer's own lengths: 1024 tokens on a GPU, 64 elsewhere.
      record = peer.run(size, int(batch), T=1024 if cuda else 64, steps=STEPS + 1, warm=WARM,
                        device="cuda" if cuda else "cpu")
    finally:
      hook.remove()
  print(json.dumps({**record, "trace": trace, "profiled_steps": STEPS}), flush=True)


def refusal(argv: list[str]) -> str:
  """Why these arguments cannot run, in one line; empty when they can."""
  if len(argv) != 3 or not argv[1].partition(":")[2].isdigit():
    return "usage: python tools/torch_profile.py PEER_SCRIPT SIZE:BATCH TRACE.json[.gz]"
  if not os.path.isfile(argv[0]):
    return f"error: the peer script {argv[0]} does not exist; tools/h200_prepare.sh copies it into .peers/."
  if not os.path.isdir(os.path.dirname(os.path.abspath(argv[2]))):
    return f"error: the folder of {argv[2]} does not exist; make it first, the trace is written at the end."
  return ""


if __name__ == "__main__":
  if why := refusal(sys.argv[1:]):
    sys.exit(why)
  main(*sys.argv[1:])
