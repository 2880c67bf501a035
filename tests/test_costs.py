"""Each context strategy, pipeline schedule and optimizer carries its own costs, which the estimator composes."""

import math

import jax
import optax
import pytest

from helpers import tiny_config
from measure import estimate, planner
from measure.dry_run import model_weights
from measure.sizes import run_of
from parallel import context, schedules
from parallel.mesh import AXES, PIPELINE, SEQUENCE
from training import optimizer
from training.state import plan


def sizes(**axes) -> dict:
  return {a: axes.get(a, 1) for a in AXES}


@pytest.mark.parametrize("name", context.STRATEGIES)
def test_every_context_strategy_has_its_collectives_and_memory(name):
  config = tiny_config(**{"attention.context": name, "mesh.data": 4, "mesh.sequence": 2})
  mesh, weights = sizes(data=4, sequence=2), model_weights(config)
  sent = estimate.collectives_by_source(config, mesh, weights)["context"]
  assert sent and all(axes == SEQUENCE for _, axes in sent), sent
  assert context.STRATEGIES[name].calls(2) > 0
  assert estimate.memory(config, mesh, weights)["activations"] > 0


@pytest.mark.parametrize("name", schedules.SCHEDULES)
def test_every_pipeline_schedule_has_its_hand_offs_and_stash(name):
  config = tiny_config(**{"pipeline.schedule": name, "pipeline.microbatches": 4, "mesh.pipeline": 2,
                          "mesh.data": 4})
  mesh, weights = sizes(data=4, pipeline=2), model_weights(config)
  sent = estimate.collectives_by_source(config, mesh, weights)["pipeline"]
  assert {kind for kind, axes in sent if axes == PIPELINE} == {"collective-permute", "all-to-all"}, sent
  costs = {"stages": 2, "micro": 4, "virtual": schedules.virtual_stages(config.pipeline)}
  assert schedules.SCHEDULES[name].held(**costs) > 0 and schedules.SCHEDULES[name].ticks(**costs) >= 4


def test_a_strategy_schedule_or_optimizer_without_its_costs_cannot_be_registered():
  with pytest.raises(TypeError):
    context.Strategy(body=lambda *args, **kwargs: None)  # pylint: disable=no-value-for-parameter
  with pytest.raises(TypeError):
    schedules.Schedule(ticks=lambda **kwargs: 1)  # pylint: disable=no-value-for-parameter
  with pytest.raises(TypeError):
    optimizer.Optimizer(rule=lambda *args: optax.sgd(1.0))  # pylint: disable=no-value-for-parameter


@pytest.mark.parametrize("name,moments", [(name, "float32") for name in optimizer.OPTIMIZERS] +
                         [("muon", "bfloat16"), ("adamw", "bfloat16")])
def test_the_estimated_optimizer_state_is_the_state_the_run_creates(name, moments):
  """The estimate reads each optimizer's state off its abstract init: on one device, the bytes of every
  state leaf shaped like a parameter (step counts and other scalars aside)."""
  config = tiny_config(**{"optimizer.name": name, "precision.moments": moments, "schedule.decay": "constant"})
  layout = plan(config, jax.devices()[:1])
  created = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(layout.abstract_state["opt_state"])
                if x.ndim)
  assert estimate.memory(config, sizes(), model_weights(config))["opt_state"] == created


def test_an_optimizer_registered_with_its_costs_needs_no_memory_table(monkeypatch):
  """Lion keeps one moment per weight: the estimate finds it in the state, with no table of names to extend."""
  lion = optimizer.Optimizer(lambda config, lr, *_: optax.lion(lr), optimizer.OPTIMIZERS["sgd"].sent,
                             optimizer.OPTIMIZERS["sgd"].flops)
  monkeypatch.setitem(optimizer.OPTIMIZERS, "lion", lion)
  config = tiny_config(**{"optimizer.name": "lion"})
  weights = model_weights(config)
  memory = estimate.memory(config, sizes(data=2), weights)
  assert memory["opt_state"] == memory["params"]


def test_the_planner_searches_every_context_strategy():
  config = tiny_config(**{"model.max_len": 64})
  searched = {flags.get("attention.context") for flags in planner.structures(run_of(config), sizes(sequence=2), sizes())}
  assert searched == set(context.STRATEGIES)
