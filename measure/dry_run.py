"""`train.py --dry_run`: compile the step ahead of time and say what it will cost, allocating nothing."""

import math

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from measure import analysis, estimate, saved_for_backward, tiers
from model.hidden import matrix_sides
from parallel import schedules
from parallel.costs import Weight
from parallel.mesh import PIPELINE, TENSOR, slow_tier_shape
from training.state import Layout, abstract_inputs, build_model, model_config, param_count
from training.step import make_train_step

MiB = 2**20
IDEAL = "ideal: 6N per token + attention, over every device, remat none"
COMPILED_FLOPS = "compiled: dots of the partitioned program, loops times trips, pipeline slots when busy"
COST_ANALYSIS = "compiled: cost_analysis() (counts each loop body once)"


def compile_partitioned_train_step(layout: Layout, config, weighted: bool = False):
  """The compiled step and its HLO before the backend's passes (analysis.compile_partitioned); batches with
  loss weights where `weighted`."""
  lowered = make_train_step(layout, config).lower(*abstract_inputs(layout, config, weighted))
  return analysis.compile_partitioned(lowered)


def busy_slots(config, mesh: dict) -> dict[int, int]:
  """How many of the pipeline's ticks each of its lax.cond slots runs (none without a pipeline)."""
  if mesh[PIPELINE] == 1:
    return {}
  p = config.pipeline
  return schedules.busy_slots(p.schedule, stages=mesh[PIPELINE], micro=p.microbatches,
                              virtual=schedules.virtual_stages(p))


def model_weights(config) -> list[Weight]:
  """Every weight's shape, logical axes and tree path, from the model's abstract (no arrays, no mesh)."""
  with nnx.use_eager_sharding(False):
    params = nnx.state(nnx.eval_shape(lambda: build_model(model_config(config), config.seed)), nnx.Param)
  is_spec = lambda x: isinstance(x, P)
  specs = jax.tree.leaves(nnx.to_pure_dict(nnx.get_partition_spec(params)), is_leaf=is_spec)
  return [Weight(tuple(x.shape), tuple(s), matrix_sides(path, tuple(s)), tuple(k.key for k in path))
          for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params)), specs, strict=True)]


def comparison(config, mesh: dict, compiled, found, found_backend) -> list[tuple[str, int, int | None, int | None]]:
  """(what, estimated bytes, partitioned bytes, CPU backend bytes) rows: memory per device, then collective bytes per step.

  `found` are the collectives of the program as partitioned, before the
  backend's passes, `found_backend` those the CPU backend compiled
  (analysis.collectives); memory has one compiled figure, in the third place.
  """
  weights = model_weights(config)
  mem, measured = estimate.memory(config, mesh, weights), analysis.memory_summary(compiled)
  arguments = mem["params"] + mem.get("reference", 0) + mem["opt_state"] + mem["batch"]
  temporaries = mem["grads"] + mem["activations"]
  rows = [(f"memory: {key}", value, None, None) for key, value in mem.items()]
  rows += [("memory: arguments (params + opt_state + batch)", arguments, measured["argument_bytes"], None),
           ("memory: temporaries (grads + activations)", temporaries, measured["temp_bytes"], None),
           ("memory: peak (arguments + temporaries)", arguments + temporaries, measured["peak_bytes"], None)]
  predicted = estimate.collectives(config, mesh, weights)
  sent, backend = analysis.traffic_per_step(found), analysis.traffic_per_step(found_backend)
  for kind, axes in sorted(set(predicted) | set(sent) | set(backend)):
    rows.append((f"{kind} over {axes}", predicted.get((kind, axes), 0), sent.get((kind, axes), 0),
                 backend.get((kind, axes), 0)))
  rows.append(("collectives: total", sum(predicted.values()), sum(sent.values()), sum(backend.values())))
  return rows


def tier_rows(config, mesh: dict, slow: dict, found) -> list[tuple[str, dict, dict]]:
  """(what, estimated, compiled) bytes per step by network tier ({"fast": ..., "slow": ...}): the
  estimate split as measure/tiers.py models it, the compiled as each replica group's slices or hosts."""
  predicted = tiers.split(estimate.collectives(config, mesh, model_weights(config)), mesh, slow,
                          config.pipeline.schedule)
  sent = analysis.tier_traffic_per_step(found)
  none = dict.fromkeys((tiers.FAST, tiers.SLOW), 0)
  rows = [(f"{kind} over {axes}", predicted.get((kind, axes), none), sent.get((kind, axes), none))
          for kind, axes in sorted(set(predicted) | set(sent))]
  total = lambda table: {tier: sum(t[tier] for t in table.values()) for tier in none}
  return rows + [("collectives: total", total(predicted), total(sent))]


def format_tiers(rows) -> str:
  lines = [f"{'per device, by network tier':<50}{'fast est MiB':>14}{'compiled':>10}{'slow est MiB':>14}"
           f"{'compiled':>10}"]
  for what, guess, actual in rows:
    lines.append(f"{what:<50}{guess[tiers.FAST] / MiB:14.2f}{actual[tiers.FAST] / MiB:10.2f}"
                 f"{guess[tiers.SLOW] / MiB:14.2f}{actual[tiers.SLOW] / MiB:10.2f}")
  return "\n".join(lines)


def format_comparison(rows) -> str:
  lines = [f"{'per device':<50}{'estimate MiB':>14}{'compiled MiB':>14}{'ratio':>8}{'CPU backend MiB':>17}"]
  for what, guess, actual, backend in rows:
    compiled = "" if actual is None else f"{actual / MiB:14.2f}"
    ratio = f"{actual / guess:8.2f}" if actual and guess else ""
    cpu = "" if backend is None else f"{backend / MiB:17.2f}"
    lines.append(f"{what:<50}{guess / MiB:14.2f}{compiled:>14}{ratio:>8}{cpu}")
  return "\n".join(lines)


def flops_rows(config, mesh: dict, compiled, partitioned) -> list[tuple[str, int | None]]:
  """(what, FLOPs per device per step): the estimate by part, the ideal, and two readings of the program."""
  weights = model_weights(config)
  guess = estimate.flops(config, mesh, weights)
  analysis_flops = (compiled.cost_analysis() or {}).get("flops")
  return [*((f"estimate: {part}", value) for part, value in guess.items()),
          (IDEAL, estimate.ideal_flops(config, mesh, weights)),
          (COMPILED_FLOPS, analysis.matmul_flops(compiled, partitioned, busy_slots(config, mesh))),
          (COST_ANALYSIS, None if analysis_flops is None else int(analysis_flops))]


def format_flops(rows) -> str:
  values = dict(rows)
  compiled = values[COMPILED_FLOPS]
  lines = [f"{'FLOPs per device per step':<66}{'GFLOP':>12}"]
  lines += [f"{what:<66}{'' if value is None else f'{value / 1e9:12.3f}'}" for what, value in rows]
  lines.append(f"compiled / estimate {compiled / values['estimate: total']:.3f}, "
               f"compiled / ideal {compiled / values[IDEAL]:.3f}")
  return "\n".join(lines)


def saved_section(layout: Layout, config, compiled) -> str:
  """What one layer keeps for the backward pass (measure/saved_for_backward.py), and that figure over the
  device's layers and tokens of one micro-batch beside the compiled step's temporaries."""
  mesh = dict(layout.mesh.shape)
  return saved_for_backward.format_budget(
      saved_for_backward.budget(layout.model), layers=estimate.stage_layers(config, mesh),
      tokens=estimate.dims(config, mesh).tokens, temporaries=analysis.memory_summary(compiled)["temp_bytes"],
      tensor=mesh[TENSOR])


def report(layout: Layout, config, weighted: bool = False) -> str:
  """Parameter count, estimated beside compiled per-device memory, collective bytes and FLOPs, and each collective
  (of the step on batches with loss weights where `weighted`)."""
  compiled, partitioned = compile_partitioned_train_step(layout, config, weighted)
  busy = busy_slots(config, dict(layout.mesh.shape))
  slow = slow_tier_shape(config.mesh, dict(layout.mesh.shape))
  found = analysis.collectives(compiled, layout.mesh, partitioned, busy, slow)
  found_backend = analysis.collectives(compiled, layout.mesh, busy=busy)
  mesh = " x ".join(f"{axis}={size}" for axis, size in layout.mesh.shape.items())
  lines = [f"parameters: {param_count(layout):,}", f"mesh: {mesh} ({layout.mesh.size} devices)",
           "memory (compiled: memory_analysis()) and collective bytes sent per step (ring traffic of the "
           "HLO's collectives, loop bodies times their trips; compiled: the program as partitioned, what a "
           "GPU or TPU compiler receives, with its all-reduce + dynamic-slice pairs read as reduce-scatters "
           "and chained all-reduces as one; CPU backend: after this CPU's own passes, which widen bf16 "
           "all-reduces to float32 and form no reduce-scatters):",
           format_comparison(comparison(config, dict(layout.mesh.shape), compiled, found, found_backend)),
           *([f"bytes across the slow tier ({' x '.join(f'dcn_{a}={n}' for a, n in slow.items() if n > 1)} "
              "slices or hosts; compiled: the slices or hosts each replica group spans):",
              format_tiers(tier_rows(config, dict(layout.mesh.shape), slow, found))]
             if math.prod(slow.values()) > 1 else []),
           saved_section(layout, config, compiled),
           format_flops(flops_rows(config, dict(layout.mesh.shape), compiled, partitioned)),
           "collectives in the partitioned train step:", analysis.summary_table(found)]
  return "\n".join(lines)
