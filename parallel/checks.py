"""Refuse, in one sentence and before anything compiles, a model or batch that does not divide over the
mesh, or that asks the devices for something they lack."""

from model.attention import SPLASH_BLOCK, kernel
from model.config import ModelConfig
from parallel.context import STRATEGIES
from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR
from parallel.schedules import SCHEDULES, virtual_stages
from parallel.stages import unequal_problem


def check_divides(model: ModelConfig, shape: dict[str, int], *, batch_size: int, grad_accum: int,
                  zero: int, pipeline=None, context: str = "allgather", fsdp_group: int = 0) -> None:
  """Raise ValueError naming the first setting that cannot be laid out on this mesh."""
  tensor, data_parallel = shape[TENSOR], shape[DATA] * shape[EXPERT]
  if zero not in (0, 1, 3):
    raise ValueError(f"sharding.zero={zero} is not a ZeRO stage meshlm runs; use 0, 1 or 3 (FSDP).")
  # Checked whatever mesh.pipeline is: a typo should not wait for the day pipelining is turned on.
  if pipeline is not None and pipeline.schedule not in SCHEDULES:
    raise ValueError(f"pipeline.schedule={pipeline.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}.")
  _divides("model.num_heads", model.num_heads, "mesh.tensor", tensor)
  # Grouped-query attention's key/value heads split over tensor too (kv_heads 0 means num_heads, checked above).
  _divides("model.kv_heads", model.num_kv_heads, "mesh.tensor", tensor)
  _divides("model.mlp_dim", model.mlp_dim, "mesh.tensor", tensor)
  _divides("the padded vocabulary", model.padded_vocab, "mesh.tensor", tensor)
  _divides("model.max_len", model.max_len, "mesh.sequence", shape[SEQUENCE])
  if model.attention == "splash":
    _check_splash(model, shape)
  if shape[SEQUENCE] > 1:
    _check_context(model, shape[SEQUENCE], tensor, context)
  if model.document_end >= 0 and model.attention == "cudnn":
    raise ValueError(
        f"packed documents (data.segments, model.document_end={model.document_end}) cannot be masked by "
        "model.attention=cudnn: JAX's cuDNN attention takes documents only as a dense T x T mask, which "
        "undoes the fused kernel's linear memory; use model.attention=auto or xla with packing.")
  if model.num_experts:
    _divides("moe.experts", model.num_experts, "mesh.expert", shape[EXPERT])
  if fsdp_group and zero == 0:
    raise ValueError(f"sharding.fsdp_group={fsdp_group} shards ZeRO's state within groups, but this run has "
                     "sharding.zero=0; use zero=1 or 3, or fsdp_group=0.")
  if zero == 3:
    axis = EXPERT if fsdp_group else DATA
    _divides("model.embed_dim", model.embed_dim, f"mesh.{axis} (FSDP shards it)", shape[axis])
    # The latent axis where a weight has no `embed` (the up-projections, the latents' norms); the down-projections
    # split by `embed` instead.
    latents = {"mla.q_rank": model.mla_q_rank, "mla.kv_rank": model.mla_kv_rank} if model.mla_kv_rank else {}
    for what, width in latents.items():
      _divides(what, width, f"mesh.{axis} (FSDP shards the latent axis)", shape[axis])
  if grad_accum < 1 or batch_size % grad_accum:
    raise ValueError(
        f"batch_size={batch_size} does not split into grad_accum={grad_accum} equal micro-batches; "
        "pick a grad_accum that divides the batch.")
  micro = batch_size // grad_accum
  if shape[PIPELINE] > 1:
    if model.moe_first_dense:
      raise ValueError(f"moe.first_dense={model.moe_first_dense}: the dense layers are a stack of their own, "
                       "which meshlm's pipelines do not split into stages yet; train them on mesh.pipeline=1.")
    speedrun = {"model.unet_skips": model.unet_skips, "model.value_embeds": model.value_embeds}
    for option, value in speedrun.items():
      if value:
        raise ValueError(f"{option}={value}: its layers read values that other pipeline stages hold (the U-net's "
                         "earlier outputs, the tokens' value rows), which meshlm's pipelines do not pass between "
                         "stages; train it on mesh.pipeline=1.")
    if model.mtp_depth:
      raise ValueError(f"model.mtp_depth={model.mtp_depth}: the prediction modules read the last stage's output "
                       "and the first stage's embedding, which meshlm's pipelines do not bring together yet; train "
                       "them on mesh.pipeline=1, or set model.mtp_depth=0.")
    _check_pipeline(model, shape[PIPELINE], micro, data_parallel, pipeline)
    if pipeline.first_stage_layers:
      if shape[SEQUENCE] > 1 and context == "ring":
        raise ValueError(
            "attention.context=ring passes blocks round a ring that every device must run together, but a "
            "shorter stage skips its empty layer slots (pipeline.first_stage_layers); use attention.context="
            "allgather or ulysses, or equal stages.")
      # Unequal stages lie split over `pipeline` by `embed` (parallel/stages.py), ahead of ZeRO-3's split.
      split = shape[PIPELINE] * (shape[EXPERT if fsdp_group else DATA] if zero == 3 else 1)
      _divides("model.embed_dim", model.embed_dim,
               "the stage weights' split (mesh.pipeline" + (" x the FSDP axis)" if zero == 3 else ")"), split)
  if micro % data_parallel:
    raise ValueError(
        f"the micro-batch of {micro} sequences (batch_size={batch_size} / grad_accum={grad_accum}) "
        f"is not divisible by the data-parallel degree data x expert = {data_parallel}; "
        f"use a multiple of {data_parallel * grad_accum} for batch_size.")


def _divides(what: str, value: int, axis: str, size: int) -> None:
  if value % size:
    raise ValueError(f"{what}={value} is not divisible by {axis}={size}; choose sizes that divide.")


def _check_pipeline(model: ModelConfig, stages: int, batch: int, data_parallel: int, pipeline) -> None:
  schedule, micro, virtual = pipeline.schedule, pipeline.microbatches, virtual_stages(pipeline)
  stashes = SCHEDULES[schedule].stashes  # 1F1B: each micro-batch's head runs as it leaves the last stage
  chunks = stages * virtual
  # A chunk holds whole scanned units: single blocks, or groups of moe.every blocks.
  problem = unequal_problem(model.num_units, model.layers_per_unit, chunks=chunks,
                            first_layers=pipeline.first_stage_layers, last_layers=pipeline.last_stage_layers)
  if problem:
    raise ValueError(f"{problem}.")
  if not pipeline.first_stage_layers and model.num_units % chunks:
    raise ValueError(
        f"model.num_layers={model.num_layers}"
        + (f" in groups of {model.layers_per_unit} (moe.every)" if model.layers_per_unit > 1
           else "")
        + f" does not split into mesh.pipeline={stages}"
        + (f" x pipeline.virtual_stages={virtual}" if SCHEDULES[schedule].virtual else "")
        + f" = {chunks} equal chunks; choose a layer count that is a multiple of {chunks * model.layers_per_unit}, "
        "or shorter first and last chunks (pipeline.first_stage_layers, pipeline.last_stage_layers).")
  if micro < 1 or batch % (micro * data_parallel):
    raise ValueError(
        f"pipeline.microbatches={micro} does not divide the batch of {batch} sequences into "
        f"micro-batches that split over data x expert = {data_parallel}; use a batch that is a "
        f"multiple of {max(micro, 1) * data_parallel}.")
  if not stashes and (batch // data_parallel) % stages:
    raise ValueError(
        f"{schedule} runs the head on 1/{stages} of each data-parallel shard's rows, but the shard's "
        f"{batch // data_parallel} sequences do not split over mesh.pipeline={stages}; use a batch that "
        f"is a multiple of {stages * data_parallel} (per grad_accum micro-batch).")
  if stashes and micro < stages:
    raise ValueError(
        f"pipeline.schedule={schedule} needs at least as many micro-batches as stages, got "
        f"pipeline.microbatches={micro} for mesh.pipeline={stages}; raise microbatches to {stages} or more.")


def attention_kernel(model: ModelConfig, shape: dict[str, int], platform: str) -> str:
  """model.attention made concrete for this mesh and platform: auto's choice (model/attention.py kernel)
  for a whole sequence, xla where that choice cannot run (splash inside a pipeline's stages, cuDNN on
  packed documents) or the sequence is sharded."""
  if model.attention != "auto":
    return model.attention
  if shape[SEQUENCE] > 1:
    return "xla"
  chosen = kernel(model, platform)
  return "xla" if (chosen == "splash" and shape[PIPELINE] > 1) or (chosen == "cudnn" and model.document_end >= 0) \
      else chosen


def _check_splash(model: ModelConfig, shape: dict[str, int]) -> None:
  if shape[PIPELINE] > 1:
    raise ValueError(f"model.attention=splash runs per device in its own shard_map, which cannot nest inside "
                     f"mesh.pipeline={shape[PIPELINE]}'s stages; use model.attention=auto or xla with a pipeline.")
  _divides("model.max_len", model.max_len, "splash attention's 128-position tiles", SPLASH_BLOCK)


def _check_context(model: ModelConfig, shards: int, tensor: int, context: str) -> None:
  if context not in STRATEGIES:
    raise ValueError(f"attention.context={context!r} is unknown; use one of {', '.join(STRATEGIES)}.")
  if model.attention in ("cudnn", "splash"):
    raise ValueError(
        f"model.attention={model.attention!r} masks by index and cannot attend over a sharded "
        "sequence; use model.attention=auto or xla with mesh.sequence > 1.")
  if context == "ring":
    _divides("model.max_len", model.max_len, "2 x mesh.sequence (zig-zag ring chunks)", 2 * shards)
  if context == "ulysses":
    _divides("model.num_heads", model.num_heads, "mesh.sequence x mesh.tensor (Ulysses splits heads)",
             shards * tensor)
    _divides("model.kv_heads", model.num_kv_heads,
             "mesh.sequence x mesh.tensor (Ulysses splits heads)", shards * tensor)


def check_backend(model: ModelConfig, device) -> None:
  """cuDNN's attention wants a GPU (elsewhere it fails while tracing). fp8 wants fp8 tensor cores
  (compute capability 8.9+: Ada, Hopper, Blackwell) on a GPU; CPUs and TPUs run it through XLA's
  conversions. Offloading remat wants host memory the device can reach."""
  if model.attention == "cudnn" and device.platform != "gpu":
    raise ValueError(f"model.attention='cudnn' needs an NVIDIA GPU, but this run's devices are "
                     f"{device.platform}; use auto (cuDNN where it applies, else xla) or xla.")
  if model.fp8 and device.platform == "gpu":
    capability = getattr(device, "compute_capability", "0.0")
    if tuple(int(part) for part in capability.split(".")) < (8, 9):
      raise ValueError(
          f"precision.compute=float8 needs fp8 tensor cores (compute capability 8.9 or newer), but "
          f"{device.device_kind} has {capability}; use bfloat16.")
  if model.remat in ("offload", "full_offload") and "pinned_host" not in {
      m.kind for m in device.addressable_memories()}:
    raise ValueError(f"model.remat={model.remat} needs pinned host memory, which {device.device_kind} does not "
                     "expose; use save_attention or full.")
