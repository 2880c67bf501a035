"""Where runs' wall time went, and a plan of goodput under host failures at scale, by Monte Carlo.

  python tools/goodput.py runs/restarted runs/survived   # each run's ledger, side by side
  python tools/goodput.py --simulate --devices 1024,16384,102400 --hours 720 --step-seconds 6

Given run directories (their --config.workdir), prints where each run's wall time went, by cause,
over all its attempts (measure/goodput.py): the table a run prints at its end, for the whole run.

For each cluster size, simulates the run over many trials (measure/goodput_simulation.py holds the
model and its assumptions) and prints a markdown row per strategy: its parameter (the checkpoint
interval of the best goodput found by sweeping, beside Young/Daly's; the peer-copy interval K), the
goodput as mean ± standard deviation over the trials, and failures per day. --help says where each
default comes from; pass your run's measured costs in their place.
"""

import argparse
import math
import sys

from measure import goodput
from measure import goodput_simulation as sim

ASSUMED = "assumed, not measured in meshlm"


def checked(kind, ok, wanted: str):
  """An argparse type: the text as `kind`, refused in one sentence that says what would do unless ok(value)."""
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not ok(value):
      raise argparse.ArgumentTypeError(f"{text} will not do; give {wanted}")
    return value
  return parse


def positive(value) -> bool:
  return 0 < value < math.inf


def at_least_zero(value) -> bool:
  return 0 <= value < math.inf


def device_counts(text: str) -> list[int]:
  return [int(part) for part in text.split(",")]


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("runs", nargs="*", metavar="RUN_DIR", help="runs whose ledgers to print side by side")
  parser.add_argument("--simulate", action="store_true",
                      help="plan by Monte Carlo: the run under failures, for each size in --devices")
  plan = parser.add_argument_group("--simulate", "a Monte Carlo plan: the run under failures, per size and strategy")
  plan.add_argument("--devices", type=checked(device_counts, lambda counts: min(counts) > 0,
                                              "device counts above 0 joined by commas, e.g. 1024,16384,102400."),
                    help="cluster sizes, comma-separated: a row per size and strategy")
  plan.add_argument("--devices-per-host", type=checked(int, positive, "a whole number above 0, e.g. 8."), default=8,
                    help="default 8: the H100 servers of Llama 3's cluster")
  plan.add_argument("--host-mtbf-hours", type=checked(float, lambda v: v > 0, "hours above 0 (inf: no failures)."),
                    default=sim.LLAMA3_HOST_MTBF_HOURS,
                    help=f"mean hours between failures of one host; default {sim.LLAMA3_HOST_MTBF_HOURS:.0f}: "
                         "Llama 3 (Meta 2024, section 3.3.4), 419 unexpected interruptions in 54 days on 16,384 "
                         "H100s in hosts of 8, 2048 x 54 x 24 / 419; Kokolis et al. 2024's RSC-1 rate, 6.50 "
                         "failures per 1,000 node-days, is 3692; inf: no failures")
  length = plan.add_mutually_exclusive_group()
  length.add_argument("--hours", type=checked(float, positive, "a number of hours above 0, e.g. 720."),
                      help="hours of training wanted, at full speed")
  length.add_argument("--steps", type=checked(int, positive, "a whole number of steps above 0, e.g. 100000."),
                      help="steps of training wanted")
  plan.add_argument("--step-seconds", type=checked(float, positive, "seconds above 0, e.g. 6."),
                    help="seconds one step takes on the whole cluster")
  cost = checked(float, at_least_zero, "seconds of 0 or more, e.g. 60.")
  plan.add_argument("--detect-seconds", type=cost, default=100.0,
                    help="seconds to declare a host lost; default 100: configs/base.py distributed.heartbeat_seconds "
                         "(docs/checkpoints.md measured 10.1 s to detect at a heartbeat of 10)")
  plan.add_argument("--restart-seconds", type=cost, default=300.0,
                    help=f"checkpoint-restart: a spare host in and every process started again; default 300, {ASSUMED}")
  plan.add_argument("--restore-seconds", type=cost, default=120.0,
                    help=f"checkpoint-restart: reading the last save back; default 120, {ASSUMED}")
  plan.add_argument("--recompile-seconds", type=cost, default=120.0,
                    help=f"compiling the step for the mesh after a failure, on either path; default 120, {ASSUMED} "
                         "at scale (a compilation-cache hit costs less)")
  plan.add_argument("--relayout-seconds", type=cost, default=23.3,
                    help="survive: the survivors rebuilding the state over the devices left, and again when a spare "
                         "rejoins; default 23.3: docs/checkpoints.md, measured on the CPU (4 processes, tiny model), "
                         "mostly that small step's compile")
  plan.add_argument("--save-seconds", type=cost, default=30.0,
                    help=f"checkpoint-restart: the blocking part of one async save; default 30, {ASSUMED} at scale")
  plan.add_argument("--replace-hours", type=checked(float, at_least_zero, "hours of 0 or more, e.g. 1."), default=1.0,
                    help=f"survive: hours until a spare host rejoins and the lost throughput is back; default 1, "
                         f"{ASSUMED}")
  plan.add_argument("--replica-devices", type=checked(int, positive, "a whole number above 0, e.g. 8."),
                    help="survive: devices of one model replica, whose throughput a lost host takes with it "
                         "(default: --devices-per-host, a replica per host)")
  plan.add_argument("--peer-copy-every", type=checked(int, positive, "a whole number of steps above 0, e.g. 100."),
                    default=100, help=f"survive with peer copies: K, steps between copies; default 100, {ASSUMED}")
  plan.add_argument("--copy-overhead", type=checked(float, at_least_zero, "a fraction of 0 or more, e.g. 0.02."),
                    default=0.02, help=f"survive with peer copies: the share of a step's time they add at K; "
                                       f"default 0.02, {ASSUMED}")
  plan.add_argument("--trials", type=checked(int, positive, "a whole number above 0, e.g. 20."), default=20,
                    help="simulated runs per strategy and size; the ± is their standard deviation")
  plan.add_argument("--seed", type=checked(int, at_least_zero, "a whole number of 0 or more, e.g. 0."), default=0,
                    help="numpy seed of the failure times")
  args = parser.parse_args(argv)
  if bool(args.runs) == args.simulate:
    parser.error("give either run directories (their --config.workdir) to read, or --simulate with --devices, "
                 "--hours or --steps, and --step-seconds, but not both.")
  if args.simulate:
    check_simulation(parser, args)
  return args


def check_simulation(parser, args) -> None:
  """Refuses, in one sentence each, what the flags cannot mean together, before anything runs."""
  missing = [flag for flag, value in (("--devices", args.devices), ("--hours or --steps", args.hours or args.steps),
                                      ("--step-seconds", args.step_seconds)) if value is None]
  if missing:
    parser.error(f"--simulate needs a value for {' and for '.join(missing)}, e.g. --devices 16384 --hours 720 "
                 "--step-seconds 6.")
  for devices in args.devices:
    if devices % args.devices_per_host:
      parser.error(f"--devices {devices} is not a whole number of hosts of {args.devices_per_host} devices; "
                   "give multiples of --devices-per-host.")
  args.replica_devices = args.replica_devices or args.devices_per_host
  if args.replica_devices > min(args.devices):
    parser.error(f"--replica-devices {args.replica_devices} is more than the {min(args.devices)} devices of the "
                 f"smallest cluster; give at most {min(args.devices)}.")
  if args.steps is None:
    args.steps = round(args.hours * 3600 / args.step_seconds)
    if args.steps < 1:
      parser.error(f"--hours {args.hours:g} is less than one step of {args.step_seconds:g} s; give at least "
                   f"{args.step_seconds / 3600:.2g} hours.")
  run = sim.Run(args.steps, args.step_seconds)
  for devices in args.devices:  # each size is simulated on its own, its failures freed before the next
    cluster = sim.Cluster(devices, args.devices_per_host, args.host_mtbf_hours)
    drawn = sim.failures_drawn(cluster, run, args.trials)
    if drawn > sim.MAX_FAILURES:
      parser.error(f"--devices {devices:,} ({cluster.hosts:,} hosts at --host-mtbf-hours {args.host_mtbf_hours:.4g}) "
                   f"over {run.seconds / 3600:,.6g} hours of steps and {args.trials} trials would draw up to "
                   f"{drawn:.2g} failure times ({sim.HORIZON}x the run's length in each trial), more than the "
                   f"{sim.MAX_FAILURES:,} failure times a simulation may hold in memory; give fewer devices, hours "
                   "or trials, or a longer --host-mtbf-hours.")


def duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "none, no failures"  # Young/Daly's interval with hosts that never fail
  if seconds < 120:
    return f"{seconds:.0f} s"
  return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def parameter(outcome: sim.Outcome, cluster: sim.Cluster, run: sim.Run, recovery: sim.Recovery, args) -> str:
  if outcome.strategy == "checkpoint-restart":
    return (f"save every {outcome.every:,} steps = {duration(outcome.every * run.step_seconds)} "
            f"(Young/Daly {duration(sim.young_daly_seconds(cluster, recovery))})")
  if outcome.strategy == "survive: peer copies":
    return f"copy every {outcome.every:,} steps, +{recovery.copy_overhead:.1%} a step"
  return f"replica of {args.replica_devices} devices back after {recovery.replace_hours:g} h"


def simulation_table(args) -> str:
  """A header saying what was simulated, then a markdown row per cluster size and strategy."""
  run = sim.Run(args.steps, args.step_seconds)
  recovery = sim.Recovery(detect=args.detect_seconds, restart=args.restart_seconds, restore=args.restore_seconds,
                          recompile=args.recompile_seconds, relayout=args.relayout_seconds, save=args.save_seconds,
                          replace_hours=args.replace_hours, copy_overhead=args.copy_overhead)
  lines = [f"{duration(run.seconds)} of training ({run.steps:,} steps of {run.step_seconds:g} s), host MTBF "
           f"{args.host_mtbf_hours:,.0f} h, {args.devices_per_host} devices per host, {args.trials} trials, "
           f"seed {args.seed}",
           f"costs (s): detect {recovery.detect:g}, restart {recovery.restart:g}, restore {recovery.restore:g}, "
           f"recompile {recovery.recompile:g}, relayout {recovery.relayout:g}, save {recovery.save:g}",
           "",
           "| devices | strategy | parameter | goodput (mean ± sd) | failures/day |",
           "| --- | --- | --- | --- | --- |"]
  for devices in args.devices:
    cluster = sim.Cluster(devices, args.devices_per_host, args.host_mtbf_hours)
    for outcome in sim.plan(cluster, run, recovery, peer_copy_every=args.peer_copy_every,
                            replica_devices=args.replica_devices, trials=args.trials, seed=args.seed):
      lines.append(f"| {devices:,} | {outcome.strategy} | {parameter(outcome, cluster, run, recovery, args)} | "
                   f"{outcome.goodput.mean():.3f} ± {outcome.goodput.std():.3f} | "
                   f"{cluster.failures_per_day:.2f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  if not args.simulate:
    try:
      print(goodput.run_table(args.runs))
    except ValueError as refusal:
      print(f"error: {refusal}", file=sys.stderr)
      return 2
    return 0
  print(simulation_table(args))
  return 0


if __name__ == "__main__":
  sys.exit(main())
