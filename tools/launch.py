"""Start a multi-process run on this machine, and optionally kill a process to watch the run survive it.

  python tools/launch.py --processes 4 -- train.py --config.mesh.data=8 --config.log_every=1
  python tools/launch.py --processes 4 --kill 2@step=30 -- train.py --config.fault_tolerance=survive ...
  python tools/launch.py --processes 4 --kill 2@step=30 --restart-after 10 -- train.py ...  # the classic path

Each process gets `--devices` simulated CPU devices and joins the others over loopback through
jax.distributed (the same flags SLURM, a TPU pod or Kubernetes would give it). Process 0 prints to
this console; the others write <workdir>/launch/process<i>.log. `--kill P@step=S` SIGKILLs process P
once <workdir>/metrics.jsonl shows step S (so log every step); `--kill P@step=S:stall=T` stops it there
(SIGSTOP) and kills it T seconds later, while the others wait for it inside the next step's
collectives. Under fault_tolerance=survive the others carry on without it, and `--restart-after` starts the killed process again that many seconds
later, to rejoin the run from a live replica's memory (GPUs only: on the CPU, gloo refuses the
restarted process; docs/checkpoints.md says what runs where). Otherwise the whole job
dies with it, and `--restart-after` starts it again, resuming from the last checkpoint. At the end a table gives, for
each kill, the steps lost and the seconds from the kill until the run finished a step past the
last one it had finished before it: the side-by-side figures of docs/checkpoints.md.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from parallel.distributed import free_port
from run.run_name import ROOT, workdir_of


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices per process")
  parser.add_argument("--kill", action="append", default=[], metavar="P@step=S[:stall=T]",
                      help="SIGKILL process P once step S is logged, or stop it then and kill it T seconds "
                           "later, inside the next step's collectives; may repeat")
  parser.add_argument("--restart-after", type=seconds, default=None, metavar="SECONDS",
                      help="restart the killed process this long after the kill, to rejoin a surviving run; "
                           "or the whole job this long after it died (the checkpoint-restart path)")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- train.py and its flags")
  args = parser.parse_args(argv)
  args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not args.command:
    parser.error("give the command to run after --, e.g. -- train.py --config.log_every=1")
  if args.processes < 2:
    parser.error(f"--processes={args.processes}: a multi-process run needs at least 2")
  args.kill = [parse_kill(text, args.processes, parser) for text in args.kill]
  return args


def seconds(text: str) -> float:
  """'10', '10s' or '2.5s' as seconds."""
  try:
    return float(text.removesuffix("s"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, e.g. 10 or 10s") from None


def parse_kill(text: str, processes: int, parser) -> tuple[int, int, float]:
  """(process, step, seconds stopped before the SIGKILL)."""
  match = re.fullmatch(r"(\d+)@step=(\d+)(?::stall=(\d+(?:\.\d+)?)s?)?", text)
  if not match:
    parser.error(f"--kill {text!r} is not P@step=S or P@step=S:stall=T, e.g. --kill 2@step=30 or "
                 "--kill 2@step=30:stall=3")
  process, step = int(match[1]), int(match[2])
  if not 0 < process < processes:
    parser.error(f"--kill {text!r}: process {process} cannot be killed; pick 1..{processes - 1} "
                 "(process 0 hosts the coordination service, and the run dies with it)")
  return process, step, float(match[3] or 0)


def start(args, logs: Path) -> list[subprocess.Popen]:
  port = free_port()
  return [start_one(args, logs, i, port) for i in range(args.processes)]


def start_one(args, logs: Path, i: int, port: int) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}")
  flags = [f"--config.distributed.coordinator=localhost:{port}",
           f"--config.distributed.num_processes={args.processes}", f"--config.distributed.process_id={i}"]
  output = None if i == 0 else open(logs / f"process{i}.log", "a")  # a rejoining process adds to its log
  return subprocess.Popen([sys.executable, *args.command, *flags], cwd=ROOT, env=env,
                          stdout=output, stderr=subprocess.STDOUT if output else None)


def coordinator_port(process: subprocess.Popen) -> int:
  return int(next(flag for flag in process.args if "coordinator=" in flag).rsplit(":", 1)[1])


def metrics_records(workdir: Path) -> list[dict]:
  """metrics.jsonl's whole records, in file order (a line being written is left out)."""
  try:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
  except FileNotFoundError:
    return []
  return [json.loads(line) for line in lines if line.endswith("}")]


def logged_steps(workdir: Path) -> list[int]:
  """Steps with a loss in metrics.jsonl, in file order (a restart first drops the records it will redo)."""
  return [r["step"] for r in metrics_records(workdir) if "loss" in r]


def steps_lost_recorded(workdir: Path) -> int:
  """The finished steps a surviving run has recorded doing again (rolled back to a peer copy)."""
  return sum(r.get("steps_lost", 0) for r in metrics_records(workdir))


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  workdir = workdir_of(args.command)
  logs = workdir / "launch"
  logs.mkdir(parents=True, exist_ok=True)
  processes, kills, results, restarts = start(args, logs), sorted(args.kill, key=lambda k: k[1]), [], 0
  watching = None  # about the last kill, until the run passes the step it had reached (below)
  killed = {}  # process -> kill time, while the others run on without it
  stalled = {}  # process -> when to SIGKILL it, while it is stopped
  rejoins = args.restart_after is not None and "--config.fault_tolerance=survive" in args.command
  ended = {}  # process -> when it was first seen ended, to name the one that ended the job
  victims = set()  # the processes --kill ended
  while True:
    done = max(logged_steps(workdir), default=0)
    if kills and done >= kills[0][1]:
      victim, _, stall = kills.pop(0)
      # The run stops gaining steps from here: [kill time, last step finished before it, lowest step
      # logged since, steps a surviving run had recorded as lost before it]
      watching = [time.perf_counter(), done, done, steps_lost_recorded(workdir)]
      if stall:
        processes[victim].send_signal(signal.SIGSTOP)
        stalled[victim] = time.perf_counter() + stall
        print(f"launch: stopped process {victim} after step {done}; killing it in {stall:g} s, while the "
              "others wait for it in the next step's collectives", flush=True)
      else:
        stalled[victim] = time.perf_counter()
    for victim, when in list(stalled.items()):
      if time.perf_counter() >= when:
        processes[victim].send_signal(signal.SIGKILL)
        victims.add(victim)
        del stalled[victim]
        if rejoins:
          killed[victim] = time.perf_counter()
        print(f"launch: killed process {victim} after step {done}", flush=True)
    if watching:
      watching[2] = min(watching[2], done)  # a restart drops the records past its checkpoint first
      if done > watching[1]:  # a restart lost the steps past its checkpoint; a rollback says what it lost
        lost = max(watching[1] - watching[2], steps_lost_recorded(workdir) - watching[3])
        results.append((watching[1], lost, time.perf_counter() - watching[0]))
        watching = None
    codes = [p.poll() for p in processes]
    for i, code in enumerate(codes):
      if code is not None:
        ended.setdefault(i, time.perf_counter())
    for victim, when in list(killed.items()):
      if codes[0] is None and time.perf_counter() - when >= args.restart_after:
        processes[victim] = start_one(args, logs, victim, coordinator_port(processes[0]))
        del killed[victim]
        ended.pop(victim, None)  # seen ended before its restart, or not yet
        victims.discard(victim)
        print(f"launch: restarted process {victim} to rejoin the run", flush=True)
    if codes[0] is not None and all(c is not None for c in codes):
      if codes[0] == 0 or args.restart_after is None or restarts > len(args.kill):
        break
      print(f"launch: the job ended (exit codes {codes}); restarting in {args.restart_after:g} s", flush=True)
      time.sleep(args.restart_after)
      processes, restarts, ended, victims = start(args, logs), restarts + 1, {}, set()
    time.sleep(0.05)
  for killed_after, lost, seconds in results:
    print(f"launch: killed after step {killed_after}: {lost} steps lost, {seconds:.1f} s until step "
          f"{killed_after + 1} was done", flush=True)
  code = processes[0].returncode
  if code:
    print(f"launch: {first_to_fail(processes, ended, victims, logs, workdir)}", flush=True)
  return code if code >= 0 else 128 - code  # a signal as the shell reports it (SIGKILL: 137)


def first_to_fail(processes: list[subprocess.Popen], ended: dict[int, float], victims: set[int],
                  logs: Path, workdir: Path) -> str:
  """One sentence naming the process whose end ended the job, how it ended, and what to do.

  Within one poll, a SIGKILLed process went first: the others of a job end by SIGABRT (JAX's
  coordination service) or an exit status (a failed collective), never by SIGKILL.
  """
  failed = [i for i in ended if processes[i].returncode]
  first = min(failed, key=lambda i: (ended[i], processes[i].returncode != -signal.SIGKILL, i))
  code = processes[first].returncode
  # Process 0 prints to this console: without survive mode, JAX's fate sharing ends it after another
  # process's loss by SIGABRT, with a C++ stack that reads like a fault of its own. It cannot end in a
  # line of its own instead: its collective with the lost process may block until that abort (jaxlib's
  # hook for the abort takes no Python callback), and under jax_enable_recoverability, which turns the
  # loss into an exception, an async save's barrier with the lost process can hold it until orbax's
  # timeout (20 minutes), and --restart-after waits for every process to end.
  aborted = (" (JAX's fate sharing aborted process 0: the C++ stack above is that abort, not a second fault)"
             if first != 0 and processes[0].returncode == -signal.SIGABRT else "")
  if code > 0:
    where = "above" if first == 0 else f"in {logs / f'process{first}.log'}"
    return f"process {first} ended first (exit status {code}), and the job with it{aborted}; its error is {where}."
  how = f"killed by {signal.Signals(-code).name}" + (" from --kill" if first in victims else "")
  host = ("; process 0 hosts the coordination service, so every process ended with it" if first == 0 else
          f", and the job with it{aborted}")
  return f"process {first} ended first ({how}){host}: {resume_advice(workdir)}."


def resume_advice(workdir: Path) -> str:
  """What running the command again does: resume from the newest checkpoint, or start over."""
  folder = workdir / "checkpoints"
  saved = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
  if saved:
    return f"run the same command to resume from checkpoint step {saved[-1]}"
  return "no checkpoint was saved, so the same command starts over from step 0"


if __name__ == "__main__":
  sys.exit(main())
