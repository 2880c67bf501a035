"""parallel/layout.py's Layout names what parallel/ reads of a run's layout: training.state.Layout has each
attribute with its type, and parallel/ reads no other, so the floor test sees the whole dependency."""

import ast
import typing

from helpers import ROOT
from parallel.layout import Layout
from training import state

CONTRACT = {name: typing.get_type_hints(member.fget)["return"]
            for name, member in vars(Layout).items() if isinstance(member, property)}


def layout_parameters(function) -> tuple[set[str], set[str]]:
  """The parameters of `function` annotated with the contract, and those named `layout` that are not."""
  arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
  typed = {a.arg for a in arguments if isinstance(a.annotation, ast.Name) and a.annotation.id == "Layout"}
  return typed, {a.arg for a in arguments if a.arg == "layout"} - typed


def test_the_training_layout_has_every_attribute_the_contract_names_with_its_type():
  fields = typing.get_type_hints(state.Layout)
  assert {name: fields.get(name) for name in CONTRACT} == CONTRACT


def test_parallel_reads_of_a_layout_stay_inside_the_contract():
  outside, untyped = [], []
  for path in sorted((ROOT / "parallel").glob("*.py")):
    for function in ast.walk(ast.parse(path.read_text())):
      if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        continue
      typed, unannotated = layout_parameters(function)
      untyped += [f"{path.name}: {getattr(function, 'name', 'lambda')}({name})" for name in sorted(unannotated)]
      outside += [f"{path.name}:{node.lineno} {node.value.id}.{node.attr}" for node in ast.walk(function)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in typed and node.attr not in CONTRACT]
  assert not untyped, f"{untyped} take a layout without the type parallel.layout.Layout; annotate them with it"
  assert not outside, f"{outside} read a layout outside parallel/layout.py's Layout; add the attribute there"
