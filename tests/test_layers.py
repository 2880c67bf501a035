"""The rooms stack: each imports only from rooms below it, so the import graph has no cycle between rooms."""

import ast
from pathlib import Path

import pytest

from helpers import ROOT

# Lowest first. Rooms on one floor may not import each other; README's code map lists them in this order.
FLOORS = (
    ("configs", "model"),
    ("parallel",),
    ("input_pipeline",),
    ("training",),
    ("measure", "interop"),
    ("resilience",),
    ("run",),
    ("train", "sample", "tools"),
)
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def first_party_imports(path: Path) -> set[str]:
  """The rooms a module imports, by the first part of each imported name."""
  rooms = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      rooms.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      rooms.add(node.module.split(".")[0])
  return rooms & FLOOR.keys()


MODULES = sorted(p.relative_to(ROOT) for room in FLOOR for p in
                 ([ROOT / f"{room}.py"] if (ROOT / f"{room}.py").is_file() else (ROOT / room).glob("*.py")))


def test_every_room_is_on_a_floor():
  packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
  assert packages - {"tests"} <= FLOOR.keys(), "a new room: give it a floor in FLOORS and README's code map"


@pytest.mark.parametrize("module", MODULES, ids=str)
def test_a_module_imports_only_from_rooms_below_its_own(module):
  room = module.parts[0] if len(module.parts) > 1 else module.stem
  upward = {other for other in first_party_imports(ROOT / module)
            if other != room and FLOOR[other] >= FLOOR[room]}
  assert not upward, f"{module} (floor {FLOOR[room]}) imports {sorted(upward)}, on its floor or above"


def reaches_into_jax_src(node: ast.AST) -> bool:
  """`import jax._src...`, `from jax._src... import`, `from jax import _src`, or `jax._src` read off jax."""
  if isinstance(node, ast.Import):
    return any(alias.name.split(".")[:2] == ["jax", "_src"] for alias in node.names)
  if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
    return (node.module.split(".")[:2] == ["jax", "_src"]
            or node.module == "jax" and any(alias.name == "_src" for alias in node.names))
  return isinstance(node, ast.Attribute) and node.attr == "_src" and getattr(node.value, "id", None) == "jax"


def test_only_the_compatibility_module_reaches_into_jax_src():
  # A private JAX name moves without notice between releases: parallel/jax_compat.py holds each one
  # the tree needs, and tests/test_jax_compat.py says in one line which one a jax upgrade moved.
  tree = [*MODULES, *sorted(p.relative_to(ROOT) for p in (ROOT / "tests").glob("*.py"))]
  reaching = [str(module) for module in tree if module != Path("parallel/jax_compat.py")
              and any(map(reaches_into_jax_src, ast.walk(ast.parse((ROOT / module).read_text()))))]
  assert not reaching, f"{reaching} import jax._src; reach the private piece through parallel/jax_compat.py"


def test_a_test_file_shares_code_through_helpers_not_through_another_test_file():
  for path in sorted((ROOT / "tests").glob("test_*.py")):
    imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
                 for alias in node.names}
    shared = sorted(name for name in imported if name.split(".")[-1].startswith("test_"))
    assert not shared, f"{path.name} imports {shared}; move what it needs into tests/helpers.py"


def _root_name(node: ast.AST) -> str | None:
  while isinstance(node, (ast.Attribute, ast.Subscript)):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def config_writes(path: Path) -> list[str]:
  """Where a module assigns into, or updates, a value named like a config (`config`, `cfg`, `*_config`)."""
  is_config = lambda node: (_root_name(node) or "").lower().endswith(("config", "cfg"))
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    for target in (t for group in targets for t in (group.elts if isinstance(group, ast.Tuple) else [group])):
      if isinstance(target, (ast.Attribute, ast.Subscript)) and is_config(target):
        found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("update", "unlock", "unlocked") and is_config(node.func.value)):
      found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
  return found


# configs/ builds configs; the entry points (train.py, sample.py, tools/) build theirs from their flags.
ROOM_MODULES = [m for m in MODULES if m.parts[0] not in ("configs", "train.py", "sample.py", "tools")]


@pytest.mark.parametrize("module", ROOM_MODULES, ids=str)
def test_a_room_reads_the_config_and_never_writes_into_it(module):
  writes = config_writes(ROOT / module)
  assert not writes, (f"{module} writes into a config after loading ({'; '.join(writes)}); build it with "
                      "configs/load.py (set_fields, restored) or hand the value on as a record")
