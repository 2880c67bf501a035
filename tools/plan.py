"""Choose the layout: every legal layout of a model on a cluster, those that fit, ranked by predicted tokens/s.

  python tools/plan.py --config=configs/gpt2.py:1558m --kind=h100 --devices=64 --global_batch=512 --seq_len=1024
  python tools/plan.py --config=configs/llama.py:405b --kind=h100 --devices=16384 --global_batch=2048 --seq_len=8192
  python tools/plan.py --config=configs/llama.py:405b --kind=h100 --devices=16384 --global_batch=2048 --seq_len=8192 --fixed=mesh.tensor=8,mesh.pipeline=16,mesh.data=128 --top=1
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/plan.py --kind=h100 --devices=8 --global_batch=16 --seq_len=128 --verify=2
  python tools/plan.py --check=benchmarks/h200/2026-12-04-equal.jsonl,benchmarks/h200/2026-12-04-layers.jsonl

Prints the top layouts with their memory per device, bytes per step on each
network tier, pipeline bubble, predicted step time, tokens/s and MFU, and the
command line that runs each (measure/planner.py says how the search prunes,
measure/step_time.py what the time model assumes). `--verify=K` compiles the
top K ahead of time on the devices jax sees (simulate them with XLA_FLAGS as
above) and prints each one's compiled memory and bytes by tier beside the
prediction. A model that fits nowhere gets one line naming the smallest
cluster it would fit. `--fixed=KEY=VALUE,...` keeps only the layouts with those
config values (a published run's mesh, say). `--check=RECORDS.jsonl,...` predicts instead each run that
tools/bench.py measured in those files, as it ran on its device kind, and prints
its step time, memory and MFU beside the measured, with the step's error.
"""

import functools
import sys
import time

from absl import app, flags, logging

from configs.load import override
from run.config_flag import define_config_flag

_CONFIG = define_config_flag("configs/gpt2.py:tiny", "Model config; --config.<field> sets fields.")
_KIND = flags.DEFINE_string("kind", "h100", "Device kind (measure/hardware.py KINDS).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Devices in the cluster.")
_FAST_GROUP = flags.DEFINE_integer("fast_group", 0, "Devices per node or slice (0: the kind's usual).")
_SLOW_BANDWIDTH = flags.DEFINE_float("slow_bandwidth", 0, "Bytes/s per device between nodes or slices (0: the kind's).")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", 0, "Sequences per step (0: the config's batch_size).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 0, "Tokens per sequence (0: the config's model.max_len).")
_PRECISION = flags.DEFINE_string("precision", "bfloat16", "Compute dtype planned for: bfloat16 or float8.")
_HEADROOM = flags.DEFINE_float("headroom", 0.1, "Share of each device's memory kept free.")
_TOP = flags.DEFINE_integer("top", 5, "Layouts to print.")
_VERIFY = flags.DEFINE_integer("verify", 0, "Compile the top K ahead of time and print compiled beside predicted.")
_CHECK = flags.DEFINE_list("check", [], "tools/bench.py JSON lines files: predict each measured run beside its record.")
_FIXED = flags.DEFINE_list("fixed", [], "Config values every layout must have, as dotted key=value pairs.")

GiB = 2**30


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep jax's compilation-cache chatter off the table
  from measure import calibration, hardware, planner  # after flag parsing, as train.py does: jax reads its flags once
  from measure.dry_run import model_weights
  if _CHECK.value:
    print(check(_CHECK.value))
    return
  try:
    if _TOP.value < 1:
      raise ValueError(f"--top={_TOP.value} would print no layout; give 1 or more.")
    cluster = hardware.cluster(_KIND.value, _DEVICES.value, _FAST_GROUP.value or None, _SLOW_BANDWIDTH.value or None)
    config = planned_config(_CONFIG.value)
    fixed = fixed_values(config, _FIXED.value)
    achievable = calibration.achievable_fraction(cluster.kind.name)
  except ValueError as error:
    sys.exit(f"error: {error}")
  started = time.time()
  weights = model_weights(config)
  result = planner.search(config, cluster, weights, achievable, _HEADROOM.value, _TOP.value, fixed)
  print(f"{cluster.devices} {cluster.kind.description} in {cluster.groups} group(s) of {cluster.fast_group} "
        f"(fast {cluster.kind.fast_link_bandwidth / 1e9:.0f} GB/s, slow {cluster.slow_link_bandwidth / 1e9:.1f} GB/s "
        f"per device), {cluster.kind.hbm_bytes / 1e9:.0f} GB each with {_HEADROOM.value:.0%} kept free; "
        f"batch {config.batch_size} x {config.model.max_len} tokens; achievable fraction of peak "
        f"{achievable:.3f} ({calibration.REFERENCES[cluster.kind.name].label}).")
  print(f"{result.meshes} mesh shapes, {result.scored} layouts scored in {time.time() - started:.1f} s.")
  if not result.ranked and fixed:
    sys.exit(f"error: no layout with {', '.join(f'{k}={v}' for k, v in fixed.items())} fits {cluster.devices} "
             f"{cluster.kind.name} devices of {cluster.kind.hbm_bytes / 1e9:.0f} GB; drop or change --fixed.")
  if not result.ranked:
    smallest = planner.smallest_fitting_cluster(config, cluster, weights, _HEADROOM.value)
    sys.exit(f"error: {planner.fits_nowhere_sentence(config, cluster, smallest)}")
  print(table(result.ranked))
  spec = flags.FLAGS["config"].config_filename
  # The fields given here, then the batch, length and precision planned for, after each layout's own flags.
  given = [a for a in sys.argv[1:] if a.startswith("--config.")]
  planned = [f"--config.batch_size={config.batch_size}", f"--config.model.max_len={config.model.max_len}",
             f"--config.precision.compute={config.precision.compute}"]
  for rank, choice in enumerate(result.ranked, 1):
    print(f"{rank}: {' '.join([choice.command(spec), *given, *planned])}")
  if _VERIFY.value:
    print(verify(config, result.ranked[:_VERIFY.value], cluster))


def check(paths: list[str]) -> str:
  """The measured rows of `paths` beside their predictions, or the one-line refusal of a bad file."""
  from measure import planning_tables
  try:
    return planning_tables.check_table(planning_tables.check_records(paths))
  except ValueError as error:
    sys.exit(f"error: {error}")


def fixed_values(config, pairs: list[str]) -> dict:
  """{dotted key: value} of `--fixed`, each value parsed as the config's field is typed."""
  fixed = {}
  for pair in pairs:
    key, equals, text = pair.partition("=")
    if not equals:
      raise ValueError(f"--fixed={pair!r} is not a key=value pair; give e.g. mesh.pipeline=16.")
    probe = config.copy_and_resolve_references()
    override(probe, key, text)
    fixed[key] = functools.reduce(getattr, key.split("."), probe)
  return fixed


def planned_config(config):
  """The config with the batch, sequence length and precision planned for."""
  config = config.copy_and_resolve_references()
  if _GLOBAL_BATCH.value:
    config.batch_size = _GLOBAL_BATCH.value
  if _SEQ_LEN.value:
    config.model.max_len = _SEQ_LEN.value
  config.precision.compute = _PRECISION.value
  return config


def table(ranked) -> str:
  from measure import planner, tiers
  rows = ["| # | mesh | settings | memory GiB | fast GiB/step | slow GiB/step | bubble s | exposed comm s "
          "| step s | tokens/s | MFU |", "|" + " --- |" * 11]
  for rank, c in enumerate(ranked, 1):
    t = c.time
    rows.append(f"| {rank} | {planner.describe_mesh(c.axes, c.slow)} | {c.settings or 'defaults'} "
                f"| {c.device_bytes / GiB:.3g} | {t.bytes_by_tier[tiers.FAST] / GiB:.3g} "
                f"| {t.bytes_by_tier[tiers.SLOW] / GiB:.3g} | {t.bubble:.3g} | {sum(t.exposed.values()):.3g} "
                f"| {t.step:.4g} | {t.tokens_per_second:,.0f} | {t.mfu:.1%} |")
  return "\n".join(rows)


def verify(config, choices, cluster) -> str:
  """Each choice compiled ahead of time on the devices jax sees: memory and bytes by tier beside the prediction."""
  import jax

  from measure import analysis, planner, tiers
  from measure.dry_run import busy_slots, compile_partitioned_train_step
  from parallel.mesh import slow_tier_shape
  from training.state import plan

  if jax.device_count() != cluster.devices:
    sys.exit(f"error: --verify compiles for {cluster.devices} devices but jax sees {jax.device_count()}; run with "
             f"XLA_FLAGS=--xla_force_host_platform_device_count={cluster.devices} before the command.")
  rows = ["| # | memory GiB, predicted / compiled | fast GiB/step, predicted / compiled "
          "| slow GiB/step, predicted / compiled |", "|" + " --- |" * 4]
  for rank, choice in enumerate(choices, 1):
    candidate = planner.configured(config, choice.flags)
    layout = plan(candidate)
    compiled, partitioned = compile_partitioned_train_step(layout, candidate)
    mesh = dict(layout.mesh.shape)
    found = analysis.collectives(compiled, layout.mesh, partitioned, busy_slots(candidate, mesh),
                                 slow_tier_shape(candidate.mesh, mesh))
    sent = analysis.tier_traffic_per_step(found)
    by_tier = {tier: sum(t[tier] for t in sent.values()) for tier in (tiers.FAST, tiers.SLOW)}
    peak = analysis.memory_summary(compiled)["peak_bytes"]
    t = choice.time
    rows.append(f"| {rank} | {choice.device_bytes / GiB:.3f} / {peak / GiB:.3f} "
                f"| {t.bytes_by_tier[tiers.FAST] / GiB:.4f} / {by_tier[tiers.FAST] / GiB:.4f} "
                f"| {t.bytes_by_tier[tiers.SLOW] / GiB:.4f} / {by_tier[tiers.SLOW] / GiB:.4f} |")
  return "\n".join(rows)


if __name__ == "__main__":
  app.run(main)
