"""All five axes at once, run by tests/test_pipeline.py in its own process (32 simulated devices, where the
suite has 8): a tiny MoE Llama on data=2 x tensor=2 x pipeline=2 x sequence=2 x expert=2 against one device
accumulating the pipeline's micro-batches. Prints one JSON line: the largest differences, the axes each
collective of the compiled train step crosses, and its bytes per kind and axes over the estimate's."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=32"

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from helpers import objective_and_gradients, setup  # noqa: E402
from measure import analysis, estimate  # noqa: E402
from measure.dry_run import compile_partitioned_train_step, model_weights  # noqa: E402

MOE_LLAMA = {"model.family": "llama", "model.kv_heads": 2, "model.num_heads": 4, "model.num_layers": 4,
             "model.embed_dim": 32, "model.mlp_dim": 64, "model.max_len": 16, "moe.experts": 4,
             "moe.capacity_factor": 1.0, "pipeline.microbatches": 2, "pipeline.schedule": "1f1b",
             "attention.context": "ring", "batch_size": 16}
FIVE_AXES = {"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2, "mesh.sequence": 2, "mesh.expert": 2}


def largest_relative_difference(actual, expected) -> float:
  return max(float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-12))
             for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)))


def main():
  _, layout, state, batch = setup({**MOE_LLAMA, "mesh.data": 1, "grad_accum": 2}, jax.devices()[:1])
  (ref_loss, ref_stats), ref_grads = jax.device_get(objective_and_gradients(layout, 2)(state["params"], batch))
  config, layout, state, batch = setup({**MOE_LLAMA, **FIVE_AXES}, jax.devices())
  (loss, stats), grads = jax.device_get(objective_and_gradients(layout)(state["params"], batch))
  compiled, partitioned = compile_partitioned_train_step(layout, config)
  found = analysis.collectives(compiled, layout.mesh, partitioned)
  sent = analysis.traffic_per_step(found)
  guess = estimate.collectives(config, dict(layout.mesh.shape), model_weights(config))
  print(json.dumps({
      "loss": float(abs(loss - ref_loss) / abs(ref_loss)),
      "stats": {key: float(np.abs(stats[key] - value).max()) for key, value in ref_stats.items()},
      "dropped": float(ref_stats["moe_dropped"]),
      "gradients": largest_relative_difference(grads, ref_grads),
      "collectives": sorted({f"{c.kind} over {'+'.join(c.axes)}" for c in found}),
      "compiled_over_estimate": {f"{kind} over {axes}": sent.get((kind, axes), 0) / guess[(kind, axes)]
                                 for kind, axes in guess},
      "total_compiled_over_estimate": sum(sent.values()) / sum(guess.values()),
  }))


if __name__ == "__main__":
  main()
