"""Refuse, in one sentence and before anything compiles, a model or batch that does not divide over the mesh."""

from model.config import ModelConfig
from parallel.mesh import DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR


def check_divides(model: ModelConfig, shape: dict[str, int], *, batch_size: int, grad_accum: int,
                  zero: int) -> None:
  """Raise ValueError naming the first setting that cannot be laid out on this mesh."""
  tensor, data_parallel = shape[TENSOR], shape[DATA] * shape[EXPERT]
  if zero not in (0, 1, 3):
    raise ValueError(f"sharding.zero={zero} is not a ZeRO stage meshlm runs; use 0, 1 or 3 (FSDP).")
  _divides("model.num_heads", model.num_heads, "mesh.tensor", tensor)
  _divides("model.mlp_dim", model.mlp_dim, "mesh.tensor", tensor)
  _divides("the padded vocabulary", model.padded_vocab, "mesh.tensor", tensor)
  if shape[PIPELINE] > 1:
    # Sharding the scanned layers over `pipeline` without a schedule would
    # gather every stage's weights each step: correct, and useless.
    raise ValueError(
        f"mesh.pipeline={shape[PIPELINE]} needs a pipeline schedule, which meshlm does not have yet; "
        "use mesh.pipeline=1 and put the devices on data or tensor.")
  _divides("model.max_len", model.max_len, "mesh.sequence", shape[SEQUENCE])
  if zero == 3:
    _divides("model.embed_dim", model.embed_dim, "mesh.data (FSDP shards it)", shape[DATA])
  if grad_accum < 1 or batch_size % grad_accum:
    raise ValueError(
        f"batch_size={batch_size} does not split into grad_accum={grad_accum} equal micro-batches; "
        "pick a grad_accum that divides the batch.")
  micro = batch_size // grad_accum
  if micro % data_parallel:
    raise ValueError(
        f"the micro-batch of {micro} sequences (batch_size={batch_size} / grad_accum={grad_accum}) "
        f"is not divisible by the data-parallel degree data x expert = {data_parallel}; "
        f"use a multiple of {data_parallel * grad_accum} for batch_size.")


def _divides(what: str, value: int, axis: str, size: int) -> None:
  if value % size:
    raise ValueError(f"{what}={value} is not divisible by {axis}={size}; choose sizes that divide.")
