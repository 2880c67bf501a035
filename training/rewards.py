"""Verifiable rewards for GRPO (config.grpo.reward): functions of (completions, answers) -> one float each.

A reward is named by one of
  exact_match     1 where the completion, stripped of surrounding space, is the answer, else 0
  format:REGEX    1 where the stripped completion matches REGEX in full, else 0 (the answer is not read)
  module:function a function of yours, importable from where train.py runs, taking the lists of completion
                  texts and answers and returning a float per completion
and a comma list of them is their sum.
"""

import importlib
import re
from typing import Callable, Sequence

Reward = Callable[[Sequence[str], Sequence[str]], list]


def exact_match(completions, answers) -> list:
  return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]


def format_match(pattern: re.Pattern) -> Reward:
  return lambda completions, answers: [float(pattern.fullmatch(c.strip()) is not None) for c in completions]


def _user_function(name: str) -> Reward:
  module_name, _, function_name = name.partition(":")
  try:
    module = importlib.import_module(module_name)
  except ImportError as error:
    raise ValueError(f"grpo.reward names {name!r}, whose module {module_name!r} cannot be imported ({error}); "
                     "name a module importable from where train.py runs.") from None
  function = getattr(module, function_name, None)
  if not callable(function):
    raise ValueError(f"grpo.reward names {name!r}, but {module_name} has no function {function_name!r}.")
  return function


def _one(name: str) -> Reward:
  if name == "exact_match":
    return exact_match
  if name.startswith("format:"):
    try:
      return format_match(re.compile(name.removeprefix("format:")))
    except re.error as error:
      raise ValueError(f"grpo.reward={name!r} holds no valid regular expression ({error}).") from None
  if ":" in name:
    return _user_function(name)
  raise ValueError(f"grpo.reward={name!r} is unknown; use exact_match, format:REGEX or module:function.")


def reward(names: str) -> Reward:
  """The reward `names` (a comma list, summed) gives: each completion's total as float. Format rewards may hold
  commas in their expressions only as the last of the list."""
  if not names.strip():
    raise ValueError("grpo.reward is empty; name one: exact_match, format:REGEX or module:function.")
  parts, rest = [], names
  while rest:
    if rest.startswith("format:"):
      parts.append(rest)
      break
    head, _, rest = rest.partition(",")
    parts.append(head.strip())
  functions = [_one(part) for part in parts]

  def total(completions, answers) -> list:
    scores = [list(function(completions, answers)) for function in functions]
    if any(len(s) != len(completions) for s in scores):
      raise ValueError(f"a reward of grpo.reward={names!r} returned {[len(s) for s in scores]} scores for "
                       f"{len(completions)} completions; return one float per completion.")
    return [float(sum(values)) for values in zip(*scores)]

  return total
