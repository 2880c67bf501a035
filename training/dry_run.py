"""`train.py --dry_run`: compile the step ahead of time and say what it will cost, allocating nothing."""

import jax

from parallel import analysis
from training.state import Layout, param_count
from training.step import make_train_step


def abstract_inputs(layout: Layout, config):
  """ShapeDtypeStructs carrying shardings for the state and one batch."""
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       layout.abstract_state, layout.state_shardings)
  token = jax.ShapeDtypeStruct((config.batch_size, layout.model.max_len), "int32",
                               sharding=layout.batch_sharding)
  return state, {"inputs": token, "targets": token}


def compile_train_step(layout: Layout, config):
  return make_train_step(layout, config).lower(*abstract_inputs(layout, config)).compile()


def report(layout: Layout, config) -> str:
  """Parameter count, per-device memory from the compiled program, and its collectives."""
  compiled = compile_train_step(layout, config)
  memory = analysis.memory_summary(compiled)
  mesh = " x ".join(f"{axis}={size}" for axis, size in layout.mesh.shape.items())
  lines = [f"parameters: {param_count(layout):,}", f"mesh: {mesh} ({layout.mesh.size} devices)",
           "per-device memory (compiled.memory_analysis()):"]
  lines += [f"  {key:22s} {value / 2**20:12.2f} MiB" for key, value in memory.items()]
  lines += ["collectives in the compiled train step:", analysis.summary_table(
      analysis.collectives(compiled, layout.mesh))]
  return "\n".join(lines)
