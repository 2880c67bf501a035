"""What a train step holds per device, by arithmetic: float32 parameters and gradients, the optimizer's state
(read off the optimizer itself, training/optimizer.py `state_bytes`), the batch, and the activations kept for
the backward pass (measure/activations.py); each sized by the rules table (parallel/rules.py) the run shards
with. Nothing is compiled or allocated."""

from measure.activations import activations
from measure.sizes import adapted, dims, run_of, stored_table, trained_weights
from parallel import rules
from parallel.costs import INT32_BYTES, MASTER_BYTES, Weight, shard_elements
from parallel.mesh import DATA, EXPERT
from training import lora, optimizer


def memory(run, mesh: dict, weights: list[Weight]) -> dict[str, int]:
  """Per-device bytes: params, gradients, optimizer state, batch, saved activations."""
  run = run_of(run)
  d = dims(run, mesh)
  local_batch = run.batch_size // (mesh[DATA] * mesh[EXPERT])
  # Inputs and targets; a preference answer's mask too; a rollout's token weights and advantages (4 bytes each).
  arrays = {"lm": 2, "dpo": 3, "grpo": 4}[run.objective]
  return {**state(run, mesh, weights), "batch": arrays * local_batch * d.length * INT32_BYTES,
          "activations": activations(run, d, weights)}


def state(run, mesh: dict, weights: list[Weight]) -> dict[str, int]:
  """Per-device bytes of the train state: float32 params, gradients, optimizer state (the update's traffic
  too, measure/step_time.py)."""
  run = run_of(run)
  zero, axis = run.sharding.zero, rules.fsdp_axis(run.sharding)
  stored = lambda ws, width=lambda w: MASTER_BYTES: sum(
      shard_elements(w, mesh, stored_table(run, mesh, w, rules.weight_rules(zero, axis))) * width(w) for w in ws)
  trained = trained_weights(run, weights)
  moments = sum(shard_elements(w, mesh, stored_table(run, mesh, w, rules.optimizer_rules(zero, axis))) * per_element
                for w, per_element in zip(trained, optimizer_state_bytes(run, trained)))
  # Under LoRA the gradients are the adapted weights' (their merged update's backward) and the adapters'.
  params = stored(weights, frozen_bytes(run)) + (stored(trained) if run.lora else 0)
  grads = stored([w for w in weights if adapted(run, w)] + trained) if run.lora else params
  # Accumulating micro-batches holds the running sum beside each micro-batch's gradients.
  held = {"params": params, "grads": grads * (2 if run.grad_accum > 1 else 1), "opt_state": moments}
  return {**held, "reference": params} if run.reference else held


def frozen_bytes(run):
  """Bytes per element of each weight as the state stores it (training/lora.py `frozen_dtype`)."""
  return lambda w: lora.frozen_dtype(run.lora, len(w.shape)).itemsize


# The planner asks the same optimizer of the same weights on thousands of layouts.
_STATE_BYTES = {}


def optimizer_state_bytes(run, weights: list[Weight]) -> list[int]:
  """training/optimizer.py `state_bytes`: what the optimizer keeps per element of each weight, read off its
  abstract state once per update rule (its name), moments' dtype and model."""
  run = run_of(run)
  key = (run.optimizer.name, run.moments, tuple(weights))
  if key not in _STATE_BYTES:
    _STATE_BYTES[key] = optimizer.state_bytes(run.optimizer, run.moments, weights)
  return _STATE_BYTES[key]
