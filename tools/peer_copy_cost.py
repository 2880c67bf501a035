"""What peer copies cost a surviving run: step time with a copy every K steps against none, in one run.

  python tools/peer_copy_cost.py                       # ZeRO-3 over 4 processes of 2 CPU devices
  python tools/peer_copy_cost.py --every 1,10,100 --steps 200 -- --config.model.embed_dim=256

Runs the same surviving ZeRO-3 job (tools/launch.py) once per K, and once with copies so rare that
none is taken (the same code otherwise), in --rounds rounds, interleaved so that the machine's
drift falls on every K alike, and prints a table: K, the time of a productive step (from each
run's goodput ledger, so compilation and start-up are left out; the fastest of the rounds) as a
ratio to no copies, the bytes one copy sends between processes and what it holds in process 0's
host memory, and the no-copy runs' spread, the noise the ratios sit in.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import goodput

ROOT = Path(__file__).resolve().parent.parent

JOB = ["--config.mesh.data=8", "--config.sharding.zero=3", "--config.fault_tolerance=survive",
       "--config.batch_size=16", "--config.eval_every=0", "--config.sample_tokens=0", "--config.checkpoint.every=0",
       "--config.model.embed_dim=64", "--config.model.mlp_dim=256", "--config.model.max_len=32"]


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--every", default="1,10,100", help="the K to measure, comma-separated")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- more train.py flags for every run")
  args = parser.parse_args(argv)
  try:
    args.every = [int(k) for k in args.every.split(",")]
  except ValueError:
    parser.error(f"--every {args.every!r} is not whole numbers joined by commas, e.g. 1,10,100")
  if min(args.every) < 1 or args.steps < max(args.every):
    parser.error(f"--every {args.every} needs each K at least 1 and at most --steps={args.steps}, so a copy is taken")
  args.flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
  return args


def measured(workdir: Path, every: int, steps: int, flags: list[str]) -> dict:
  """One run's seconds per productive step and its first copy's figures."""
  command = [sys.executable, "tools/launch.py", "--processes=4", "--", "train.py", *JOB, *flags,
             f"--config.steps={steps}", f"--config.log_every={steps}", f"--config.peer_copy_every={every}",
             f"--config.workdir={workdir}"]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  if result.returncode:
    sys.exit(f"error: the run with peer_copy_every={every} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
  records = goodput.records(workdir / "metrics.jsonl")
  copy = next((r for r in records if "peer_copy_bytes_sent" in r), {})
  return {"step_seconds": goodput.run_ledger(workdir)["productive"] / steps,
          "sent": copy.get("peer_copy_bytes_sent"), "host": copy.get("peer_copy_host_bytes")}


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  never = 10 * args.steps  # past the last step: the surviving run takes no copy
  rounds = {k: [] for k in [never, *args.every]}
  with tempfile.TemporaryDirectory() as scratch:
    for r in range(args.rounds):
      for k, done in rounds.items():
        done.append(measured(Path(scratch) / f"{k}-{r}", k, args.steps, args.flags))
  runs = {k: min(done, key=lambda run: run["step_seconds"]) for k, done in rounds.items()}
  base, spread = runs.pop(never), [run["step_seconds"] for run in rounds[never]]
  print(f"ZeRO-3 over data=8 on 4 processes of 2 CPU devices, {args.steps} steps, the fastest of {args.rounds} "
        f"rounds; no copies: {1e3 * base['step_seconds']:.1f} ms a step (its rounds {max(spread) / min(spread):.3f}x "
        "apart)")
  print("| copy every K steps | step time / no copies | sent per copy (all processes) | host memory, process 0 |")
  print("|---:|---:|---:|---:|")
  for k, run in runs.items():
    print(f"| {k} | {run['step_seconds'] / base['step_seconds']:.3f}x | {run['sent'] / 2**20:.2f} MiB | "
          f"{run['host'] / 2**20:.2f} MiB |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
