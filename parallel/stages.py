"""How the stacked units split into pipeline stages: equally, or with the first and last stages shorter.

A model whose layer count does not divide over the stages (Llama 3 405B's 126 layers over 16) runs with
`pipeline.first_stage_layers` and `pipeline.last_stage_layers` set, as Megatron-LM's
--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers do: the first and last
chunks (virtual stages, under interleaving) hold that many layers and the chunks between split the
rest equally. A mesh axis splits an array's dimension only into equal parts, so such a stack cannot
lie split over `pipeline` by layer: it lies split by `embed` (parallel/rules.py `split_by_embed`), and
each step the pipeline gathers every device's stage from it by one all-to-all into `slots` slots per
chunk, the longest chunk's length; a slot beyond a shorter chunk's layers is skipped under lax.cond
(model/transformer.py `scan_blocks`). Every tick then lasts as long as the longest chunk.
"""

import numpy as np

from parallel.schedules import virtual_stages


def stage_units(model, pipeline, stages: int) -> tuple[int, ...] | None:
  """Units in each chunk (virtual stage) of `model` (a ModelConfig) over `stages` stages as `pipeline` (the
  config's, or the estimator's record of it) sets them, in virtual-stage order; None when they split equally
  or there is no pipeline. The settings are checked by parallel/checks.py before this runs."""
  if stages == 1 or not (pipeline.first_stage_layers or pipeline.last_stage_layers):
    return None
  chunks = stages * virtual_stages(pipeline)
  first, last = (layers // model.layers_per_unit for layers in (pipeline.first_stage_layers,
                                                                  pipeline.last_stage_layers))
  middle = (model.num_units - first - last) // (chunks - 2) if chunks > 2 else 0
  return (first, *[middle] * (chunks - 2), last)


def unequal_problem(num_units: int, layers_per_unit: int, *, chunks: int, first_layers: int,
                    last_layers: int) -> str | None:
  """Why the first and last chunks' layers cannot split the stack as asked, in a sentence; None when they can."""
  if not (first_layers or last_layers):
    return None
  layers = num_units * layers_per_unit
  if first_layers < 1 or last_layers < 1:
    return (f"pipeline.first_stage_layers={first_layers} and pipeline.last_stage_layers={last_layers} must "
            "both be set (at least 1) to split the layers unequally, or both 0 to split them equally")
  if first_layers % layers_per_unit or last_layers % layers_per_unit:
    return (f"pipeline.first_stage_layers={first_layers} and pipeline.last_stage_layers={last_layers} must be "
            f"multiples of {layers_per_unit}, the layers a scanned unit holds (moe.every)")
  rest = layers - first_layers - last_layers
  if chunks == 2 and rest:
    return (f"pipeline.first_stage_layers={first_layers} + pipeline.last_stage_layers={last_layers} must be "
            f"model.num_layers={layers} with two chunks; use last_stage_layers={layers - first_layers}")
  if chunks > 2 and (rest < chunks - 2 or rest % ((chunks - 2) * layers_per_unit)):
    return (f"the {rest} layers between pipeline.first_stage_layers={first_layers} and "
            f"pipeline.last_stage_layers={last_layers} do not split equally over the {chunks - 2} middle "
            f"chunks; choose first and last so that num_layers - first - last is a multiple of "
            f"{(chunks - 2) * layers_per_unit}")
  return None


def shorter_ends(num_units: int, layers_per_unit: int, chunks: int) -> dict[str, int] | None:
  """The pipeline flags that split a stack which does not divide into `chunks` equal chunks: the middle
  chunks as long as an equal split rounded up, the first and last sharing the rest (126 units over 16:
  8 each, and 7 at each end); {} when the chunks are equal, None when no such split exists."""
  if num_units % chunks == 0:
    return {}
  longest = -(-num_units // chunks)
  ends = num_units - (chunks - 2) * longest
  first = ends // 2
  if first < 1 or ends - first > longest:
    return None
  return {"pipeline.first_stage_layers": first * layers_per_unit,
          "pipeline.last_stage_layers": (ends - first) * layers_per_unit}


def slots(units: tuple[int, ...]) -> int:
  """Slots per chunk: the longest chunk's units."""
  return max(units)


def slot_units(units: tuple[int, ...], stages: int) -> np.ndarray:
  """[stages, virtual, slots]: the stack's unit in each slot of each device's chunks (chunk v of device p is
  virtual stage vP + p), 0 in a slot beyond its chunk's units (never run)."""
  virtual, width = len(units) // stages, slots(units)
  starts = np.cumsum((0, *units[:-1]))
  table = np.zeros((stages, virtual, width), np.int32)
  for p in range(stages):
    for v in range(virtual):
      s = v * stages + p
      table[p, v, :units[s]] = starts[s] + np.arange(units[s])
  return table


def live_slots(units: tuple[int, ...], stages: int) -> np.ndarray:
  """[stages, virtual, slots]: whether each slot holds one of its chunk's units."""
  virtual, width = len(units) // stages, slots(units)
  return np.array([[np.arange(width) < units[v * stages + p] for v in range(virtual)] for p in range(stages)])
