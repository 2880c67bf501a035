"""What parallel/ reads of a run's layout, as a type on parallel's floor.

training.state.Layout (two floors up) satisfies it structurally: the pipeline and the placements take
any object with these attributes, and tests/test_layout_contract.py holds both sides to this list:
each attribute is a field of training.state.Layout, and parallel/ reads no other off a layout.
Read-only properties, since the layout they describe is a frozen record.
"""

from typing import Protocol

from flax import nnx
from jax.sharding import Mesh

from model.config import ModelConfig


class Layout(Protocol):
  @property
  def mesh(self) -> Mesh: ...

  @property
  def model(self) -> ModelConfig: ...  # the placements ask for experts, the pipeline for the document end

  @property
  def graphdef(self) -> nnx.GraphDef: ...  # the pipeline rebuilds the model from it inside each stage

  @property
  def used_shardings(self) -> dict: ...  # each weight as the step uses it

  @property
  def moment_shardings(self) -> dict: ...  # each weight's gradient, split as its optimizer moments

  @property
  def schedule(self) -> str: ...  # the pipeline schedule

  @property
  def microbatches(self) -> int: ...

  @property
  def virtual_stages(self) -> int: ...

  @property
  def stage_units(self) -> tuple[int, ...] | None: ...  # units per chunk when the stages are unequal

  @property
  def context(self) -> str: ...  # the attention strategy over `sequence`
