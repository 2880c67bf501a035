"""Dynamic loss scaling for float16 compute (Micikevicius et al. 2018, "Mixed Precision Training").

float16 keeps 5 exponent bits: small gradients flush to zero. The loss is
multiplied by a scale S before differentiation, which lifts every gradient
by S, and the float32 gradients are divided by S before the update. When a
step overflows (an inf or NaN gradient) the update is skipped, as any
non-finite step is (training/step.py), and S halves; after `growth_interval`
finite steps in a row S doubles, so it settles just below overflow.
"""

import jax.numpy as jnp

MIN_SCALE = 1.0


def uses_loss_scaling(config) -> bool:
  return config.precision.compute == "float16"


def initial(scale: float) -> dict:
  return {"scale": jnp.asarray(scale, jnp.float32), "good_steps": jnp.zeros((), jnp.int32)}


def update(state: dict, finite, growth_interval: int) -> dict:
  """Halve on overflow; double after growth_interval finite steps in a row."""
  good_steps = jnp.where(finite, state["good_steps"] + 1, 0)
  grow = good_steps >= growth_interval
  scale = jnp.where(finite, jnp.where(grow, state["scale"] * 2, state["scale"]),
                    jnp.maximum(state["scale"] / 2, MIN_SCALE))
  return {"scale": scale, "good_steps": jnp.where(grow, 0, good_steps)}
