"""What one device works on in a train step, as the estimator's modules all read it: the run's settings as
one frozen record (`Run`, which the planner varies layout by layout), the per-device sizes (parallel/costs.py
Dims) of a run on a mesh, how often its layers run, what a pipeline stage holds at once, which weights are
matrices and which is the head, and the registered optimizer's costs' arguments."""

import dataclasses
from typing import Any

import numpy as np

from model import moe
from model.config import VOCAB_MULTIPLE, ModelConfig
from model.transformer import chunk_count, chunk_positions
from parallel import context, rules, schedules, stages as stage_split
from parallel.costs import Dims, Weight, shard_elements
from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR
from training import lora, optimizer, preference
from training.lora import Lora
from training.state import model_config


@dataclasses.dataclass(frozen=True)
class Pipeline:
  schedule: str
  microbatches: int
  virtual_stages: int
  first_stage_layers: int = 0
  last_stage_layers: int = 0


@dataclasses.dataclass(frozen=True)
class Sharding:
  zero: int
  fsdp_group: int


@dataclasses.dataclass(frozen=True)
class Attention:
  context: str


@dataclasses.dataclass(frozen=True)
class Run:
  """What the estimator reads of a run beside its weights and mesh, read once from a config (`run_of`): the
  model, the batch, the layout's settings (named as the config's keys, so the planner sets them by key) and
  the optimizer."""
  model: ModelConfig
  batch_size: int  # sequences per step: a preference pair (objective=dpo) is two, its prompt with each answer
  grad_accum: int
  attention: Attention
  pipeline: Pipeline
  sharding: Sharding
  optimizer: Any  # config.optimizer, which its registered costs read (training/optimizer.py)
  moments: str  # precision.moments
  # objective=dpo's (or grpo's, beta > 0) frozen reference (training/preference.py, training/grpo.py): float32
  # weights laid out as the parameters, run forward once per step on the whole batch
  reference: bool = False
  objective: str = "lm"
  lora: Lora | None = None  # LoRA's adapters train, the weights stay frozen (training/lora.py)


def run_of(config) -> Run:
  """The Run of a config (or the Run given)."""
  if isinstance(config, Run):
    return config
  p, settings = config.pipeline, preference.settings(config)
  return Run(model=model_config(config), batch_size=config.batch_size * (1 if settings is None else 2),
             grad_accum=config.grad_accum,
             attention=Attention(config.attention.context),
             pipeline=Pipeline(p.schedule, p.microbatches, p.virtual_stages, p.first_stage_layers,
                               p.last_stage_layers),
             sharding=Sharding(config.sharding.zero, config.sharding.fsdp_group), optimizer=config.optimizer,
             moments=config.precision.moments, reference=preference.keeps_reference(config),
             objective=config.objective, lora=lora.settings(config))


def replaced(run: Run, flags: dict) -> Run:
  """`run` with `flags` (dotted config keys) set; the mesh's keys are left to the mesh the estimate is given."""
  top, sections = {}, {}
  for key, value in flags.items():
    section, _, field = key.rpartition(".")
    if section == "mesh":
      continue
    if section:
      sections.setdefault(section, {})[field] = value
    else:
      top[field] = value
  return dataclasses.replace(run, **top, **{section: dataclasses.replace(getattr(run, section), **fields)
                                            for section, fields in sections.items()})


def expert_slots(model: ModelConfig, length: int) -> int:
  """Capacity slots per expert for a sequence of `length`, as model/moe.py sizes them."""
  return moe.slots(length, model.num_experts, model.moe_top_k, model.moe_capacity_factor, model.moe_dropless)


def dims(run, mesh: dict) -> Dims:
  """The sizes one device works on in `run` (a Run or a config) on `mesh` (axis sizes after hybrid sharding)."""
  run = run_of(run)
  m, tensor = run.model, mesh[TENSOR]
  micro = schedules.micro_batches(run, mesh[PIPELINE])
  padded_vocab = -(-m.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  batch = run.batch_size // micro // (mesh[DATA] * mesh[EXPERT])
  strategy, length = run.attention.context if mesh[SEQUENCE] > 1 else "none", m.max_len // mesh[SEQUENCE]
  # Each query scores the whole sequence, except where the keys visit a block at a time; then attention
  # keeps no scores for its backward pass, as it does past one block (model/attention.py).
  keys = length if context.visiting(strategy) else m.max_len
  return Dims(mesh=mesh, batch=batch, length=length, full_length=m.max_len, keys=keys,
              blockwise=context.visiting(strategy) or max(length, keys) > m.attention_block, embed=m.embed_dim,
              mlp=m.mlp_dim // tensor, heads=m.num_heads // tensor,
              kv_heads=(m.kv_heads or m.num_heads) // tensor,
              head_dim=getattr(m, "head_width", 0) or m.embed_dim // m.num_heads,
              vocab=padded_vocab // tensor, compute_bytes=compute_bytes(run),
              context=strategy,
              attention_block=m.attention_block,
              loss_positions=m.max_len // mesh[SEQUENCE] // chunk_count(
                  m.max_len, chunk_positions(m.loss_chunk, batch, mesh[SEQUENCE])),
              mlp_chunks=chunk_count(m.max_len, chunk_positions(m.mlp_chunk, batch, mesh[SEQUENCE])) if m.mlp_chunk else 1)


def compute_bytes(run) -> int:
  """Bytes per activation value: float8 multiplies in fp8 but keeps its activations in bfloat16."""
  run = run_of(run)
  return np.dtype(run.model.dtype).itemsize


def layer_passes(run, mesh) -> tuple[int, int]:
  """(forward, backward) runs of one device's layers per step, counted in micro-batches.

  Recomputation (a remat policy) runs the forward again.
  """
  run = run_of(run)
  # A pipeline stage runs each micro-batch once; its idle ticks are skipped (lax.cond), except where the
  # context strategy's keys visit (the ring): every device runs its hops together, so there a stage
  # computes on every tick of its slots.
  forward = schedules.micro_batches(run, mesh[PIPELINE])
  if mesh[PIPELINE] > 1 and mesh[SEQUENCE] > 1 and context.visiting(run.attention.context):
    p = run.pipeline
    ((ticks, busy),) = schedules.busy_slots(p.schedule, stages=mesh[PIPELINE], micro=p.microbatches,
                                            virtual=schedules.virtual_stages(p)).items()
    forward = forward * ticks // busy
  backward = forward
  return forward * (2 if run.model.remat in ("full", "full_offload") else 1), backward


def stage_units(run, mesh: dict) -> tuple[int, ...] | None:
  """Units in each chunk (virtual stage) when the pipeline's stages are unequal (parallel/stages.py); None
  when they are equal or there is no pipeline."""
  run = run_of(run)
  return stage_split.stage_units(run.model, run.pipeline, mesh[PIPELINE])


def stage_layers(run, mesh: dict) -> int:
  """The layers one device runs per micro-batch: its stage's, or with unequal stages the slots of its chunks,
  the longest chunk's length each (every tick lasts as long as the longest chunk, and a device's busiest
  slots set its memory)."""
  run = run_of(run)
  units = stage_units(run, mesh)
  if units is None:
    return run.model.num_layers // mesh[PIPELINE]
  return schedules.virtual_stages(run.pipeline) * stage_split.slots(units) * run.model.layers_per_unit


def blocks_run(run, mesh: dict) -> int:
  """The blocks one device runs per micro-batch: its stage's layers (stage_layers), and one block per multi-token
  prediction module (model/mtp.py), which only runs without a pipeline."""
  run = run_of(run)
  return stage_layers(run, mesh) + run.model.mtp_depth


def routed_layers(model, layers: int) -> int:
  """The MoE layers among a stage's `layers`: every moe_every-th after the first moe_first_dense dense ones
  (which a pipeline never splits: parallel/checks.py)."""
  return (layers - model.moe_first_dense) // model.moe_every


def routed_blocks(run, mesh: dict) -> int:
  """The routed blocks one device runs per micro-batch: its stage's MoE layers, and with experts the multi-token
  prediction modules' blocks (model/mtp.py)."""
  run = run_of(run)
  m = run.model
  return routed_layers(m, stage_layers(run, mesh)) + (m.mtp_depth if m.num_experts else 0)


def adapted(run, w: Weight) -> bool:
  """Whether LoRA adapts weight `w` (a kernel it targets, training/lora.py)."""
  name = str(w.path[-1]) if w.path else ""
  return bool(run.lora) and name.endswith("_kernel") and name.removesuffix("_kernel") in run.lora.kernels and (
      lora.split_axes(w.axes) is not None)


def adapter_weights(run, weights: list[Weight]) -> list[Weight]:
  """LoRA's factors A and B of each adapted weight, as training/lora.py lays them out; none without LoRA."""
  run = run_of(run)
  out = []
  for w in weights:
    if not adapted(run, w):
      continue
    lead, inputs = lora.split_axes(w.axes)
    cut, r = lead + inputs, run.lora.rank
    out += [Weight((*w.shape[:cut], r), (*w.axes[:cut], None), None, (*w.path, lora.A)),
            Weight((*w.shape[:lead], r, *w.shape[cut:]), (*w.axes[:lead], None, *w.axes[cut:]), None,
                   (*w.path, lora.B))]
  return out


def trained_weights(run, weights: list[Weight]) -> list[Weight]:
  """What the optimizer updates: the weights, or under LoRA their adapters."""
  run = run_of(run)
  return adapter_weights(run, weights) if run.lora else weights


def stored_table(run, mesh: dict, w: Weight, table) -> tuple:
  """The rules `table` as weight `w` lies by it: a stack of unequal stages split over `pipeline` by `embed`."""
  return rules.split_by_embed(table) if w.stacked and stage_units(run, mesh) is not None else table


def stage_elements(run, mesh: dict, w: Weight) -> int:
  """Elements of a stacked weight that one device's stage computes with (whole over data): its
  layers' (stage_layers) share of the weight laid out without `pipeline`."""
  run = run_of(run)
  whole = shard_elements(w, {**mesh, PIPELINE: 1}, rules.weight_rules(0))
  return whole * stage_layers(run, mesh) // run.model.num_layers


def held_layers(run, mesh: dict) -> tuple[int, int]:
  """(copies, layers): how many micro-batches' residuals a device holds at once, each for this many
  layers. One without a pipeline; 1F1B's stash slots; GPipe's and the interleaved schedule's every
  tick of the stage loop, each for the layers of one virtual stage."""
  run = run_of(run)
  layers, stages = stage_layers(run, mesh), mesh[PIPELINE]
  if stages == 1:
    return 1, layers
  p, virtual = run.pipeline, schedules.virtual_stages(run.pipeline)
  return schedules.SCHEDULES[p.schedule].held(stages=stages, micro=p.microbatches, virtual=virtual), layers // virtual


def is_matrix(w: Weight) -> bool:
  """A weight the tokens multiply: an `embed` axis and another beside `layers` and `expert` (not a bias or norm)."""
  return "embed" in w.axes and any(a not in ("embed", "layers", "expert") for a in w.axes)


def head_weights(run, weights) -> list[Weight]:
  """The logits' weight: GPT-2's tied token table (vocab, embed), Llama's (embed, vocab) head; a lookup is no matmul."""
  run = run_of(run)
  axes = ("vocab", "embed") if run.model.traits.tied_head else ("embed", "vocab")
  return [w for w in weights if w.axes == axes]


def optimizer_of(run) -> optimizer.Optimizer:
  run = run_of(run)
  return optimizer.registered(run.optimizer.name)


def optimizer_costs(run, mesh, weights) -> tuple:
  """The arguments of the optimizer's costs (training/optimizer.py Optimizer): the stack's moments' rules
  (Muon's matrices are all in the stack)."""
  run = run_of(run)
  table = rules.optimizer_rules(run.sharding.zero, rules.fsdp_axis(run.sharding))
  return run.optimizer, rules.split_by_embed(table) if stage_units(run, mesh) else table, mesh, weights
