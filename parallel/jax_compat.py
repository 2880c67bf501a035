"""The private JAX pieces the tree uses: the only module that imports `jax._src`.

Each piece is looked up when it is used, so a jax upgrade that moves one breaks only what needs it,
with one sentence naming the jax version, the missing name and the way out. tests/test_jax_compat.py
looks every piece up in the installed jax, so an upgrade that moves one fails there first.
"""

import importlib

import jax

TESTED_JAX = "0.11.2"  # constraints.txt's pin: the jax these pieces were read against

# (module, name): what the tree reads it for.
PIECES = {
    ("jax._src.distributed", "global_state"):
        "the coordination service's client (key-value store, barriers, live processes)",
    ("jax._src.interpreters.partial_eval", "partial_eval_jaxpr_nounits"):
        "the 1F1B stash analysis (which of a stage's residuals depend on its input)",
    ("jax._src.config", "enable_compilation_cache"):
        "switching the persistent compilation cache off around one compile",
}


def private(module: str, name: str):
  """`module.name` from the installed jax, or ImportError with one line saying what moved."""
  try:
    return getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError):
    raise ImportError(f"jax {jax.__version__} moved {module}.{name}, which parallel/jax_compat.py reads for "
                      f"{PIECES[module, name]}; pin jax=={TESTED_JAX} (constraints.txt) or update "
                      "parallel/jax_compat.py") from None


def coordination_client():
  """The coordination service's client of an initialized multi-process run.

  Public `jax.distributed` offers only initialize/shutdown/is_initialized; the key-value store,
  barriers and live-node query are reached through its private global state, as JAX's fault
  tolerance guide does.
  """
  return private("jax._src.distributed", "global_state").client


def partial_eval_jaxpr_nounits(jaxpr, unknowns, instantiate):
  """JAX's partial evaluation of a closed jaxpr: which outputs are unknown given which inputs are.

  No public API (jax.extend included) says which outputs of a traced function depend on which of
  its inputs; the pipeline reads it off the jaxpr that partial evaluation leaves unknown.
  """
  return private("jax._src.interpreters.partial_eval", "partial_eval_jaxpr_nounits")(jaxpr, unknowns, instantiate)


def compilation_cache_disabled():
  """A context manager inside which JAX's persistent compilation cache is off.

  The public `jax.config.update("jax_enable_compilation_cache", ...)` switches it for the whole
  process and restores nothing on an error; the private config state scopes the switch to a block.
  """
  return private("jax._src.config", "enable_compilation_cache")(False)
