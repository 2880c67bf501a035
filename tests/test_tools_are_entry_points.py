"""tools/ holds entry points only: command lines over code that lives in the rooms.

The rule, checked on every module (the rooms, the tools themselves, train.py, sample.py, tests, the
notebooks' code cells): only a test may import a tool, only as `from tools import <tool>` (an alias
allowed), and only to call what makes it a command line, its `main` or `parse_args`. Whatever else a
test, a room or another tool needs from a tool belongs in a room. And no tool edits sys.path: the project
is installed (editable), so `python tools/x.py` finds the rooms, and tools/h200_check.sh sets PYTHONPATH
on a machine where it is not.
"""

import ast
import json
from pathlib import Path

from helpers import ROOT

ENTRY_POINTS = {"main", "parse_args"}
NOT_CODE = {"meshlm.egg-info", "runs", "data"}  # what installs and runs leave


def notebook_source(path: Path) -> str:
  """A notebook's code cells as one module; shell (`!`) and magic (`%`) lines become `pass`."""
  cells = [cell["source"] for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]
  lines = "\n".join("".join(cell) if isinstance(cell, list) else cell for cell in cells).splitlines()
  return "\n".join(line[:len(line) - len(line.lstrip())] + "pass" if line.lstrip()[:1] in ("!", "%") else line
                   for line in lines)


def modules(root: Path = ROOT) -> list[Path]:
  tops = [p for p in root.iterdir() if not p.name.startswith(".") and p.name not in NOT_CODE]
  files = [p for top in tops for p in ([top] if top.suffix == ".py" else top.rglob("*.py") if top.is_dir() else [])]
  return sorted(files + list(root.glob("notebooks/*.ipynb")))


def tool_uses(path: Path, root: Path = ROOT) -> list[str]:
  """How `path` (under `root`) reaches into tools/, a line for each use that breaks the rule; [] when none does."""
  text = notebook_source(path) if path.suffix == ".ipynb" else path.read_text()
  tree = ast.parse(text)
  is_test = path.relative_to(root).parts[0] == "tests"
  broken, tools = [], set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      broken += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "tools"]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tools":
      names = ", ".join(a.name for a in node.names)
      if node.module != "tools" or not is_test:
        broken.append(f"line {node.lineno}: from {node.module} import {names}")
      else:
        tools |= {alias.asname or alias.name for alias in node.names}
  attribute_of = {id(node.value): node for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and node.id in tools:
      used = attribute_of.get(id(node))
      if used is None or used.attr not in ENTRY_POINTS:
        broken.append(f"line {node.lineno}: {ast.unparse(used or node)}, not a tool's main or parse_args")
  return broken


def test_only_a_test_imports_a_tool_and_only_to_run_it():
  broken = {str(path.relative_to(ROOT)): uses for path in modules() if (uses := tool_uses(path))}
  assert not broken, (f"{broken} reach into tools/; move what they need into the room it belongs to, and leave "
                      "the tool its flags, main and printing")


def sys_path_edits(path: Path) -> list[int]:
  """The lines where `path` touches sys.path."""
  return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, ast.Attribute) and node.attr == "path"
          and isinstance(node.value, ast.Name) and node.value.id == "sys"]


def test_a_tool_leaves_sys_path_alone():
  edits = {path.name: lines for path in sorted(ROOT.glob("tools/*.py")) if (lines := sys_path_edits(path))}
  assert not edits, (f"tools/ touches sys.path ({edits}: file and lines); the project is installed editable, so "
                     "`python tools/x.py` finds the rooms without it")


def test_the_rule_catches_what_it_names(tmp_path):
  (tmp_path / "tests").mkdir()
  (tmp_path / "measure").mkdir()
  (tmp_path / "tools").mkdir()
  cases = {
      "tests/test_ok.py": ("from tools import goodput as tool\ntool.main([])\ntool.parse_args([])\n", 0),
      "tests/test_inside.py": ("from tools import sweep\nsweep.run_one()\n", 1),
      "tests/test_from_module.py": ("from tools.sweep import main\n", 1),
      "tests/test_import.py": ("import tools.sweep\n", 1),
      "measure/room.py": ("from tools import sweep\nsweep.main([])\n", 1),
      "tools/other.py": ("from tools import sweep\nsweep.main([])\n", 1),
  }
  for name, (text, _) in cases.items():
    (tmp_path / name).write_text(text)
  assert {name: len(tool_uses(tmp_path / name, tmp_path)) for name in cases} == {n: c for n, (_, c) in cases.items()}
