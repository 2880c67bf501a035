"""Configs named outside train.py's flag: `FILE:VARIANT`, then `field=value` overrides, checked like the flag's.

Tools that take several configs in one invocation (tools/bench.py) cannot use
ml_collections' single `--config` flag; this gives them the same locked
configs and the same refusal of a misspelt field.
"""

import importlib.util
import os

import ml_collections

from configs.base import base

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def load(spec: str) -> ml_collections.ConfigDict:
  """`configs/gpt2.py:124m` (variant optional), locked."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise ValueError(f"the config file {path!r} does not exist; give one like configs/gpt2.py:tiny.")
  module_spec = importlib.util.spec_from_file_location(f"meshlm_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(variant) if variant else module.get_config()
  config.lock()
  return config


def set_fields(config: ml_collections.ConfigDict, fields: dict) -> ml_collections.ConfigDict:
  """`config` with each dotted field of `fields` set to its value (already of the field's type); returned."""
  for path, value in fields.items():
    *parents, leaf = path.split(".")
    node = config
    for name in parents:
      node = node[name]
    if leaf not in node:  # a misspelt field would otherwise be a new one nothing reads
      raise KeyError(f"{path} is not a config field; the fields of {'.'.join(parents) or 'the config'} are "
                     f"{', '.join(sorted(node.keys()))}.")
    node[leaf] = value
  return config


def with_fields(config: ml_collections.ConfigDict, fields: dict) -> ml_collections.ConfigDict:
  """A copy of `config` with the dotted `fields` set, the config it came from left as it was: what a run
  decides after loading (an imported checkpoint's shape) is a new config, never a write into a loaded one."""
  return set_fields(config.copy_and_resolve_references(), fields)


def restored(stored: dict, fields: dict) -> ml_collections.ConfigDict:
  """A saved run's `stored` config over configs/base.py's (fields added since it was saved keep their
  defaults), then the dotted `fields` (a mesh or precision to read it with)."""
  config = base()
  config.update(stored)
  return set_fields(config, fields)


def override(config: ml_collections.ConfigDict, path: str, text: str) -> None:
  """Set the dotted field `path` from `text`, parsed as the type the field already has."""
  *parents, leaf = path.split(".")
  node = config
  for name in parents:
    if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
      raise ValueError(f"the config has no field {path!r}; configs/base.py lists every field.")
    node = node[name]
  if leaf not in node or isinstance(node[leaf], ml_collections.ConfigDict):
    raise ValueError(f"the config has no field {path!r}; configs/base.py lists every field.")
  node[leaf] = _parse(path, text, type(node[leaf]))


def _parse(path: str, text: str, kind: type):
  if kind is bool:
    if text.lower() not in _TRUE + _FALSE:
      raise ValueError(f"{path}={text!r} is not a boolean; use true or false.")
    return text.lower() in _TRUE
  if kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      raise ValueError(f"{path}={text!r} is not a number of type {kind.__name__}.") from None
  return text
