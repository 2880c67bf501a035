"""Schedule-free AdamW (training/schedule_free.py): optax's method with the state holding x, the average.

Against optax's own schedule_free (which holds y): the same gradients give the same y and the same
x (its schedule_free_eval_params) to float32 rounding, 1e-6 relative. On a mesh, parameters after STEPS
steps equal one device's within 1e-5, as every optimizer's do (tests/test_equivalence.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import (assert_params_close, batch_at, objective_and_gradients, params_after_steps, setup,
                     tiny_config, train_steps)
from interop.export import export
from measure import analysis, estimate
from measure.dry_run import compile_partitioned_train_step, model_weights
from run.loop import train
from training import schedule_free
from training.checkpoint import Checkpoints
from training.state import init_state, plan

SCHEDULE_FREE = {"optimizer.name": "schedule_free_adamw", "schedule.decay": "constant"}


def test_holding_the_average_is_optax_s_schedule_free_seen_from_x():
  schedule = optax.linear_schedule(0.0, 0.05, 3)
  target = {"w": jnp.linspace(-1.0, 2.0, 12).reshape(3, 4), "b": jnp.array([0.5, -0.25])}
  loss = lambda p: sum(jnp.sum(jnp.cos(p[k]) * (p[k] - target[k]) ** 2) for k in p)
  start = {"w": jnp.zeros((3, 4)), "b": jnp.ones(2)}
  decays = {"w": True, "b": False}
  ours = schedule_free.schedule_free_adamw(schedule, 0.9, 0.95, 1e-8, 0.1, decays)
  theirs = optax.contrib.schedule_free(optax.adamw(schedule, b1=0.0, b2=0.95, eps=1e-8, weight_decay=0.1,
                                                   mask=decays), schedule, b1=0.9)
  x, x_state, y, y_state = start, ours.init(start), start, theirs.init(start)
  for _ in range(8):
    step, x_state = ours.update(jax.grad(loss)(schedule_free.gradient_point(x_state, x)), x_state, x)
    x = optax.apply_updates(x, step)
    step, y_state = theirs.update(jax.grad(loss)(y), y_state, y)
    y = optax.apply_updates(y, step)
  for k in start:
    np.testing.assert_allclose(x[k], optax.contrib.schedule_free_eval_params(y_state, y)[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(schedule_free.gradient_point(x_state, x)[k], y[k], rtol=1e-6, atol=1e-7)
  assert np.abs(x["w"] - y["w"]).max() > 1e-3  # the average and the gradient point are apart


def test_the_train_step_takes_its_gradient_at_y():
  """Three train steps equal three steps by hand whose gradients are taken at gradient_point, not at x."""
  config, layout, state, _ = setup({**SCHEDULE_FREE, "mesh.data": 1}, jax.devices()[:1])
  by_hand, grad_at = jax.device_get(state), objective_and_gradients(layout)
  for i in range(3):
    _, grads = grad_at(schedule_free.gradient_point(by_hand["opt_state"], by_hand["params"]), batch_at(config, layout, i))
    updates, opt_state = layout.tx.update(grads, by_hand["opt_state"], by_hand["params"])
    by_hand = {"params": optax.apply_updates(by_hand["params"], updates), "opt_state": opt_state}
  stepped = train_steps(config, layout, state, 3)
  assert_params_close(jax.device_get(stepped["params"]), jax.device_get(by_hand["params"]), "schedule-free steps")


@pytest.fixture(scope="module")
def one_device():
  return params_after_steps({**SCHEDULE_FREE, "mesh.data": 1}, jax.devices()[:1])


LAYOUTS = {"zero1 data=8": {"mesh.data": 8, "sharding.zero": 1},
           "fsdp data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2, "sharding.zero": 3},
           "data=4 x pipeline=2": {"mesh.data": 4, "mesh.pipeline": 2}}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_mesh_trains_as_one_device(one_device, name):
  assert_params_close(params_after_steps({**SCHEDULE_FREE, **LAYOUTS[name]}, jax.devices()), one_device,
                      f"schedule-free on {name}")


@pytest.mark.parametrize("overrides, says", [
    ({"optimizer.name": "schedule_free_adamw"}, r"^optimizer.name='schedule_free_adamw' averages its iterates in "
                                                r"place of a decay; set schedule.decay=constant"),
    ({**SCHEDULE_FREE, "precision.moments": "bfloat16"}, r"^precision.moments='bfloat16': schedule-free's state "
                                                         r"holds z, a copy of the weights"),
])
def test_refuses_a_decay_and_rounded_state(tmp_path, overrides, says):
  config = tiny_config(**overrides, workdir=str(tmp_path / "run"))
  with pytest.raises(ValueError, match=says) as raised:
    train(config)
  assert "\n" not in str(raised.value)
  assert not (tmp_path / "run").exists()


def test_the_state_holds_z_and_v_and_zero1_gathers_z_once():
  """The state is z and v beside the weights (no Adam first moment, which b1 = 0 would keep at zero), and
  under ZeRO-1 the gradient point gathers z once a step beside the updated weights, not in each layer loop:
  the compiled program's all-gathers exceed AdamW's by the estimate's z, to the byte."""
  key, sent, estimated = ("all-gather", "data"), {}, {}
  for name, overrides in (("schedule-free", SCHEDULE_FREE), ("adamw", {})):
    config = tiny_config(**overrides, **{"mesh.data": 8, "sharding.zero": 1})
    layout = plan(config)
    if name == "schedule-free":
      size = lambda tree: sum(leaf.size for leaf in jax.tree.leaves(tree) if leaf.ndim)
      assert size(layout.abstract_state["opt_state"]) == 2 * size(layout.abstract_state["params"])
    program, partitioned = compile_partitioned_train_step(layout, config)
    sent[name] = analysis.traffic_per_step(analysis.collectives(program, layout.mesh, partitioned))[key]
    estimated[name] = estimate.collectives(config, dict(layout.mesh.shape), model_weights(config))[key]
  assert estimated["schedule-free"] == 2 * estimated["adamw"]
  assert sent["schedule-free"] - sent["adamw"] == estimated["adamw"], (sent, estimated)


def test_a_checkpoint_written_while_the_state_held_a_first_moment_is_refused_naming_the_change(tmp_path):
  """Before commit c25a3c0 the inner AdamW (b1 = 0) held a first moment, always zero: a checkpoint of that
  layout is refused in one line that names it and leaves it as it was, and its weights still export."""
  config = tiny_config(**SCHEDULE_FREE, steps=4, eval_every=0, sample_tokens=0, workdir=str(tmp_path / "run"))
  with pytest.MonkeyPatch.context() as patch:  # optax.adamw(b1=0)'s first stage, as the inner rule was then
    patch.setattr(optax, "scale_by_rms", lambda b2, eps, **_: optax.scale_by_adam(b1=0.0, b2=b2, eps=eps))
    old = init_state(plan(config), config.seed)
  checkpoints = Checkpoints(config.workdir, every=0, keep=None)
  checkpoints.save_now(2, old, config)
  checkpoints.close()
  before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
  moments = len(jax.tree.leaves(old["params"]))
  with pytest.raises(ValueError, match=(
      rf"^checkpoint step 2 in {tmp_path}/run/checkpoints holds schedule-free AdamW's state as written before "
      rf"commit c25a3c0 dropped its first moment \(its {moments} leaves under opt_state/1/base_optimizer_state/0/mu, "
      r"always zero\), .*; resume it with a checkout from before c25a3c0 \(git checkout c25a3c0~1\), or export "
      r"its weights with tools/export\.py and start from them with --config\.init_from=hf:")) as raised:
    train(config)
  assert "\n" not in str(raised.value)
  assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before
  assert export(config.workdir, str(tmp_path / "exported")).startswith("exported step 2")
