"""The layout planner: every legal layout of a model on a cluster, those that fit, ranked by predicted speed.

A layout is a mesh (data, tensor, pipeline, sequence, expert, and which of data
and pipeline cross the slow tier between slices or hosts) and the settings that
go with it (ZeRO stage and hybrid groups, pipeline schedule, micro-batches and
virtual stages, the attention strategy over `sequence`, the remat policy,
gradient accumulation, MLP and loss chunking). Legal means what `train.py` itself
accepts (parallel/checks.py), and tensor, sequence and expert stay inside one
fast-tier group. Each layout's memory per device comes from measure/estimate.py
(and what an offloading policy parks in host memory must fit the host's share)
and its step time from measure/step_time.py.

The search stays quick for any cluster by pruning before scoring: mesh shapes
by divisibility (a power-of-two cluster of 16K devices has a few dozen), then
each layout's best case (no recomputation, one micro-batch, no chunking: the
fastest its memory knobs can make it) is scored, and layouts are searched for
the settings that fit in order of that best case, stopping once a best case is
slower than the top N found.
"""

import dataclasses
import itertools

import ml_collections

from configs.load import with_fields
from measure import estimate, step_time
from measure.hardware import Cluster
from measure.sizes import Run, replaced, run_of
from parallel import context
from parallel.checks import check_divides
from parallel.mesh import AXES, DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR, hybrid_shape
from parallel.schedules import SCHEDULES
from parallel.stages import shorter_ends

# The memory knobs, fastest first within each: what the backward pass keeps (every model.remat policy;
# tests/test_planner.py holds the two lists equal), the MLP whole or in chunks of this many tokens
# per device (recomputed in the backward pass), and the head and loss in chunks of this many tokens per
# device (the config's default, then a quarter of its logits; step_time prices both alike, so a smaller
# chunk is chosen only where it makes a layout fit).
REMAT_ORDER = ("none", "save_dots", "save_attention", "offload", "full", "full_offload")
MLP_CHUNKS = (0, 4096)
LOSS_CHUNKS = (4096, 1024)
MEMORY_KNOBS = ("model.remat", "model.mlp_chunk", "model.loss_chunk", "grad_accum")
VIRTUAL_STAGES = (2, 4)


@dataclasses.dataclass(frozen=True)
class Choice:
  """One ranked layout: the config flags that run it, and what it is predicted to cost."""
  flags: dict  # dotted config keys to values, beside the config's own
  axes: dict  # axis sizes as the flags give them: `data` whole
  mesh: dict  # axis sizes as the step runs them (after hybrid sharding)
  slow: dict  # slow-tier groups per axis
  memory: dict  # estimate.memory's parts, bytes per device
  time: step_time.StepTime

  @property
  def device_bytes(self) -> int:
    return sum(self.memory.values())

  @property
  def settings(self) -> str:
    """The settings beside the mesh, short: `zero=3 group=8 1f1b M=16 remat=full accum=2`."""
    short = {"sharding.zero": "zero", "sharding.fsdp_group": "group", "pipeline.schedule": "",
             "pipeline.virtual_stages": "V", "pipeline.microbatches": "M",
             "pipeline.first_stage_layers": "first", "pipeline.last_stage_layers": "last", "attention.context": "",
             "model.remat": "remat", "model.mlp_chunk": "mlp_chunk", "model.loss_chunk": "loss_chunk",
             "grad_accum": "accum"}
    return " ".join(f"{name}={self.flags[key]}" if name else str(self.flags[key])
                    for key, name in short.items() if key in self.flags)

  def command(self, config_arg: str) -> str:
    flags = " ".join(f"--config.{key}={value}" for key, value in self.flags.items())
    return f"python train.py --config={config_arg} {flags}"


@dataclasses.dataclass(frozen=True)
class Plan:
  ranked: list[Choice]
  meshes: int  # mesh shapes legal on the cluster
  scored: int  # layouts scored (best cases and settings tried)


def divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def mesh_shapes(run: Run, cluster: Cluster):
  """(mesh sizes, slow-tier groups per axis) for every mesh the cluster can hold: tensor x sequence x
  expert inside one fast-tier group, the slow tier's groups spread over data and pipeline."""
  devices, fast, groups = cluster.devices, cluster.fast_group, cluster.groups
  experts = run.model.num_experts
  units = run.model.num_units
  for tensor in divisors(fast):
    for sequence in divisors(fast // tensor):
      for expert in (divisors(fast // (tensor * sequence)) if experts else [1]):
        rest = devices // (tensor * sequence * expert)
        # A stack that does not divide over the stages splits with shorter first and last stages.
        for pipeline in (p for p in divisors(rest) if shorter_ends(units, 1, p) is not None):
          data = rest // pipeline
          for slow_pipeline in (g for g in divisors(groups) if pipeline % g == 0):
            slow_data = groups // slow_pipeline
            if data % slow_data:
              continue
            yield ({DATA: data, PIPELINE: pipeline, EXPERT: expert, SEQUENCE: sequence, TENSOR: tensor},
                   {DATA: slow_data, PIPELINE: slow_pipeline})


def structures(run: Run, mesh: dict, slow: dict):
  """The flags of every layout on one mesh but its memory knobs (ZeRO and hybrid groups, the pipeline's
  schedule and micro-batches, the attention strategy), as the config keys train.py reads."""
  base = {f"mesh.{a}": mesh[a] for a in AXES}
  base.update({f"mesh.dcn_{a}": n for a, n in slow.items() if n > 1})
  replicas_in_group = mesh[DATA] // slow[DATA]
  shardings = [{"sharding.zero": 0}]
  for zero in (1, 3):
    shardings.append({"sharding.zero": zero})
    if mesh[EXPERT] == 1:  # hybrid sharding runs its groups on `expert`
      shardings += [{"sharding.zero": zero, "sharding.fsdp_group": g}
                    for g in divisors(replicas_in_group) if 1 < g < mesh[DATA] and (mesh[DATA] // g) % slow[DATA] == 0]
  if mesh[PIPELINE] > 1:
    # Any micro-batch count from one per stage up to one sequence each (interleaved: a multiple of the stages).
    stages, per_replica = mesh[PIPELINE], run.batch_size // (mesh[DATA] * mesh[EXPERT])
    counts = [m for m in divisors(per_replica) if m >= stages]
    plain = [name for name, schedule in SCHEDULES.items() if not schedule.virtual]
    units, per_unit = run.model.num_units, run.model.layers_per_unit
    schedules = [{"pipeline.schedule": s, "pipeline.microbatches": m, **shorter_ends(units, per_unit, stages)}
                 for s in plain for m in counts]
    schedules += [{"pipeline.schedule": s, "pipeline.virtual_stages": v, "pipeline.microbatches": m, **ends}
                  for s in SCHEDULES if s not in plain for v in VIRTUAL_STAGES for m in counts if m % stages == 0
                  if (ends := shorter_ends(units, per_unit, stages * v)) is not None]
  else:
    schedules = [{}]
  contexts = [{"attention.context": c} for c in context.STRATEGIES] if mesh[SEQUENCE] > 1 else [{}]
  for sharding, schedule, strategy in itertools.product(shardings, schedules, contexts):
    yield {**base, **sharding, **schedule, **strategy}


def configured(config, flags: dict):
  """`config` with `flags` (dotted keys) set: a ConfigDict for one, or a Run (measure/sizes.py) cheaply for the
  thousands of layouts the search scores, sharing every part no flag touches."""
  if isinstance(config, ml_collections.ConfigDict):
    return with_fields(config, flags)
  return replaced(config, flags)


def legal(run: Run, mesh: dict) -> bool:
  """Whether train.py accepts `run` on `mesh` (the checks it runs before compiling anything)."""
  try:
    check_divides(run.model, mesh, batch_size=run.batch_size, grad_accum=run.grad_accum, zero=run.sharding.zero,
                  pipeline=run.pipeline, context=run.attention.context, fsdp_group=run.sharding.fsdp_group)
  except ValueError:
    return False
  return True


def memory_knobs(run: Run, mesh: dict, kind_has_host_link: bool):
  """Flags of the memory knobs in the order to try them: remat policies fastest first, then the MLP
  in chunks and the head and loss in smaller chunks (each where a device's micro-batch has more tokens
  than a chunk), then more micro-batches of accumulation (each a smaller step's worth held at once)."""
  micro = run.pipeline.microbatches if mesh[PIPELINE] > 1 else 1
  per_replica = run.batch_size // (mesh[DATA] * mesh[EXPERT] * micro)
  accums = [a for a in divisors(per_replica) if a & (a - 1) == 0]  # powers of two
  policies = [p for p in REMAT_ORDER if kind_has_host_link or "offload" not in p]
  tokens = per_replica * run.model.max_len // mesh[SEQUENCE]
  chunks = [c for c in MLP_CHUNKS if c < tokens]
  losses = [LOSS_CHUNKS[0]] + [c for c in LOSS_CHUNKS[1:] if c < tokens]
  for remat, chunk, loss in itertools.product(policies, chunks, losses):
    yield [{"model.remat": remat, "model.mlp_chunk": chunk, "model.loss_chunk": loss, "grad_accum": a}
           for a in accums]


def search(config, cluster: Cluster, weights: list, achievable: float, headroom: float = 0.1,
           top: int = 10, fixed: dict | None = None) -> Plan:
  """The `top` fastest layouts of `config` (its batch_size and max_len as given) that fit on `cluster`
  with `headroom` of each device's memory, and of its share of host memory, left free; `fixed` (dotted
  keys) keeps only the layouts with those values (a published run's mesh and remat policy, say)."""
  fixed = fixed or {}
  budget = cluster.kind.hbm_bytes * (1 - headroom), (cluster.kind.host_bytes or 0) * (1 - headroom)
  host_link = step_time.host_link_bandwidth(cluster) is not None
  run = run_of(config)
  best_cases, meshes, scored = [], 0, 0
  for mesh_sizes, slow in mesh_shapes(run, cluster):
    meshes += 1
    for flags in structures(run, mesh_sizes, slow):
      if not _agrees(config, flags, fixed, exclude=MEMORY_KNOBS):
        continue
      candidate = configured(run, {**flags, "model.remat": "none", "model.mlp_chunk": 0, "grad_accum": 1})
      mesh = hybrid_shape(mesh_sizes, candidate.sharding.fsdp_group)
      if not legal(candidate, mesh):
        continue
      scored += 1
      fastest = step_time.predict(candidate, mesh, slow, cluster, weights, achievable)
      best_cases.append((fastest.step, flags, mesh, slow))
  best_cases.sort(key=lambda case: case[0])
  ranked = []
  for fastest_step, flags, mesh, slow in best_cases:
    if len(ranked) >= top and fastest_step >= ranked[top - 1].time.step:
      break
    choice, tried = _best_fitting(config, run, flags, mesh, slow, cluster, weights, achievable, budget, host_link,
                                  fixed)
    if choice is not None:
      choice = dataclasses.replace(choice, flags=_changed(config, choice.flags))
    scored += tried
    if choice is not None:
      ranked.append(choice)
      ranked.sort(key=lambda c: c.time.step)
  return Plan(ranked=ranked[:top], meshes=meshes, scored=scored)


def _best_fitting(config, run, flags, mesh, slow, cluster, weights, achievable, budget, host_link, fixed):
  """The fastest settings of the memory knobs of `run` (read from `config`) that fit `budget` (bytes on the
  device, bytes in host memory), as a Choice (None if none fits), and how
  many settings were scored. Each remat policy and chunking is a ladder of more and more micro-batches,
  whose first rung is its fastest; ladders are climbed fastest first rung first, each only while its
  rungs can still beat the best fit found, and stop at their first fit (more micro-batches only add
  reductions)."""
  ladders = []
  for ladder in memory_knobs(configured(run, flags), mesh, host_link):
    rungs = [(knobs, c) for knobs in ladder if _agrees(config, knobs, {k: fixed[k] for k in MEMORY_KNOBS if k in fixed})
             and legal(c := configured(run, {**flags, **knobs}), mesh)]
    if rungs:
      fastest = step_time.predict(rungs[0][1], mesh, slow, cluster, weights, achievable)
      ladders.append((fastest.step, rungs))
  ladders.sort(key=lambda ladder: ladder[0])
  best, tried = None, len(ladders)
  for fastest_step, rungs in ladders:
    if best is not None and fastest_step >= best.time.step:
      break
    for knobs, candidate in rungs:
      tried += 1
      memory = estimate.memory(candidate, mesh, weights)
      if sum(memory.values()) > budget[0] or estimate.host_memory(candidate, mesh) > budget[1]:
        continue
      predicted = step_time.predict(candidate, mesh, slow, cluster, weights, achievable)
      if best is None or predicted.step < best.time.step:
        best = Choice(flags={**flags, **knobs}, axes={a: flags[f"mesh.{a}"] for a in AXES}, mesh=mesh, slow=slow,
                      memory=memory, time=predicted)
      break
  return best, tried


def _value(config, key: str):
  node = config
  for part in key.split("."):
    node = getattr(node, part)
  return node


def _changed(config, flags: dict) -> dict:
  """The flags whose values differ from `config`'s, in their order."""
  return {key: v for key, v in flags.items() if _value(config, key) != v}


def _agrees(config, flags: dict, fixed: dict, exclude: tuple = ()) -> bool:
  """Whether `flags` (the config's own value where a key is absent) hold every `fixed` value but those
  of the `exclude` keys."""
  return all(flags.get(key, _value(config, key)) == value for key, value in fixed.items() if key not in exclude)


def smallest_fitting_cluster(config, cluster: Cluster, weights: list, headroom: float = 0.1,
                             most: int = 2**20) -> int | None:
  """The fewest devices of the cluster's kind (doubling from its size) on which some layout fits, by
  memory alone: ZeRO-3 over every data device, full recomputation, the MLP and the loss in chunks and the
  most micro-batches; None below `most`."""
  budget = cluster.kind.hbm_bytes * (1 - headroom)
  run = run_of(config)
  devices = cluster.devices * 2
  while devices <= most:
    bigger = dataclasses.replace(cluster, devices=devices)
    for mesh, slow in mesh_shapes(run, bigger):
      for flags in structures(run, mesh, slow):
        if flags.get("sharding.zero") != 3 or "sharding.fsdp_group" in flags:
          continue
        lean = configured(run, {**flags, "model.remat": "full", "model.mlp_chunk": MLP_CHUNKS[-1],
                                "model.loss_chunk": LOSS_CHUNKS[-1]})
        per_replica = lean.batch_size // (mesh[DATA] * mesh[EXPERT] *
                                           (lean.pipeline.microbatches if mesh[PIPELINE] > 1 else 1))
        lean = dataclasses.replace(lean, grad_accum=max(a for a in divisors(max(per_replica, 1)) if a & (a - 1) == 0))
        if legal(lean, mesh) and sum(estimate.memory(lean, mesh, weights).values()) <= budget:
          return devices
    devices *= 2
  return None


def describe_mesh(mesh: dict, slow: dict) -> str:
  """`data=8 (2 slow) x tensor=8`: the axes above 1, with the slow-tier groups each crosses."""
  parts = [f"{a}={mesh[a]}" + (f" ({slow[a]} slow)" if slow.get(a, 1) > 1 else "") for a in AXES if mesh[a] > 1]
  return " x ".join(parts) or "one device"


def fits_nowhere_sentence(config, cluster: Cluster, smallest: int | None) -> str:
  size = f"{config.model.num_layers} layers of width {config.model.embed_dim}"
  where = (f"the smallest {cluster.kind.name} cluster it fits on, doubling from {cluster.devices}, is "
           f"{smallest} devices" if smallest else f"no {cluster.kind.name} cluster up to a million devices holds it")
  return (f"no layout of this model ({size}, batch {config.batch_size} x {config.model.max_len} tokens) fits "
          f"{cluster.devices} {cluster.kind.name} devices of {cluster.kind.hbm_bytes / 1e9:.0f} GB; {where}.")

