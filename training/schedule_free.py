"""Schedule-free AdamW (Defazio et al., "The Road Less Scheduled", 2024) with the parameters at the point
evaluations use.

Schedule-free keeps three sequences: z, where AdamW's steps go (at a constant rate after warmup); x, the
running average of z, weighted by the squared peak rate so far, which is what evaluation, sampling and export
should see; and y = b1 x + (1 - b1) z between them, where the gradient is taken. optax's
`schedule_free` holds y as the parameters; here the train state holds x, so every checkpoint, evaluation,
sample and export is the averaged model with nothing to convert, and the step takes its gradient at
`gradient_point` (training/step.py). The update itself is optax's: y is formed from x and z, handed to
it, and x recovered from its new y and z.
"""

import jax
import optax
from optax.contrib import ScheduleFreeState


def _state_of(opt_state) -> ScheduleFreeState | None:
  """The schedule-free state inside an optimizer's state (clipping chains it), or None without one."""
  found = jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, ScheduleFreeState))
  return next((s for s in found if isinstance(s, ScheduleFreeState)), None)


def _between(x, z, b1):
  return jax.tree.map(lambda xi, zi: b1 * xi + (1 - b1) * zi, x, z)


def gradient_point(opt_state, params):
  """Where the step takes its gradient: y for schedule-free, the parameters themselves otherwise."""
  state = _state_of(opt_state)
  return params if state is None else _between(params, state.z, state.b1)


# Where the inner AdamW's first moment lay in the state, always zero, until commit c25a3c0 dropped it.
FIRST_MOMENT = "base_optimizer_state/0/mu"


def held_a_first_moment(unexpected: list[str], missing: list[str]) -> bool:
  """Whether a checkpoint's leaves differ from this state's only by that first moment: this optimizer's
  layout before c25a3c0, which no longer restores, rather than another optimizer's state."""
  return bool(unexpected) and not missing and all(f"/{FIRST_MOMENT}/" in name for name in unexpected)


def schedule_free_adamw(learning_rate, b1, b2, eps, weight_decay, decays) -> optax.GradientTransformation:
  """optax's schedule-free AdamW (decoupled decay where `decays`, taken at y) on parameters held at x."""
  # AdamW with b1 = 0, as optax's schedule_free_adamw builds it: scale_by_rms does not hold Adam's first
  # moment, which would stay zero and cost a copy of the weights.
  adamw_without_momentum = optax.chain(optax.scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True),
                                       optax.add_decayed_weights(weight_decay, decays),
                                       optax.scale_by_learning_rate(learning_rate))
  inner = optax.contrib.schedule_free(adamw_without_momentum, learning_rate, b1=b1)

  def update(grads, state, params):
    y = _between(params, state.z, state.b1)
    y_step, state = inner.update(grads, state, y)
    x = jax.tree.map(lambda yi, si, zi: (yi + si - (1 - b1) * zi) / b1, y, y_step, state.z)
    return jax.tree.map(lambda new, old: new - old, x, params), state

  return optax.GradientTransformation(inner.init, update)
