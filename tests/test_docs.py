"""README.md and docs/*.md stay true to the tree: every command in their ```bash blocks is in the
manifest (docs/commands.json), run by a named test or listed with the reason none runs it; every
relative link reaches a file; README stays a front page (at most 250 lines) whose code map names
every module there is and none that is gone.

A command is a line of a ```bash block, its trailing `# comment` dropped; a line ending in `\\` goes
on into the next; a heredoc (`<<'EOF'` ... `EOF`) is one command with its body; an `export NAME=VALUE`
line is not a command of its own but sets the environment of the block's later commands, so it is
written in front of each of them (`NAME=VALUE python ...`), as the shell would run them.
"""

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from run.run_name import default_workdir

MANIFEST = ROOT / "docs" / "commands.json"
README_MAX_LINES = 250
# Top-level folders whose modules are not the code map's: the tests, and what tools and notebooks leave.
NOT_MAPPED = {"tests", "notebooks", "docs", "runs", "data"}
# Commands that finish in seconds: run here as the docs write them (`python` is this interpreter).
RUN_HERE = [  # the first is README's: a data x tensor step compiled and reported, about 15 s on 2 cores
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py --config.mesh.data=4 --config.mesh.tensor=2 "
    "--dry_run",
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/pipeline_bubble.py --stages 4 --micro 8 "
    "--virtual 2",
    "python tools/goodput.py --simulate --devices 1024,16384,102400 --devices-per-host 8 --hours 720 "
    "--step-seconds 1 --peer-copy-every 10 --copy-overhead 0.005",
]


def pages() -> list[Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def strip_comment(line: str) -> str:
  """`line` without a trailing shell comment: a `#` that starts a word outside quotes."""
  quote = None
  for i, char in enumerate(line):
    if quote:
      quote = None if char == quote else quote
    elif char in "'\"":
      quote = char
    elif char == "#" and (i == 0 or line[i - 1].isspace()):
      return line[:i].rstrip()
  return line.rstrip()


def bash_commands(markdown: str) -> list[str]:
  """The commands of every ```bash block in `markdown`, as the module docstring defines them."""
  commands, fence, heredoc, body, pending, env = [], None, None, [], "", ""
  for line in markdown.splitlines():
    stripped = line.strip()
    if fence is None:
      if stripped.startswith("```bash"):
        fence, env = line[:len(line) - len(line.lstrip())], ""
      continue
    if heredoc:
      body.append(line[len(fence):] if line.startswith(fence) else line)
      if stripped == heredoc:
        commands.append("\n".join(body))
        heredoc = None
      continue
    if stripped.startswith("```"):
      fence = None
      continue
    if not stripped or stripped.startswith("#"):
      continue
    command = pending + strip_comment(stripped)
    if command.endswith("\\"):
      pending = command[:-1]
      continue
    pending = ""
    exported = re.fullmatch(r"export\s+(\w+=\S+)", command)
    if exported:
      env += exported.group(1) + " "
      continue
    command = env + command
    opens = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", command)
    if opens:
      heredoc, body = opens.group(1), [command]
      continue
    commands.append(command)
  assert fence is None and heredoc is None, "a ```bash block or a heredoc that never ends"
  return commands


def documented() -> dict[str, list[str]]:
  """Every command of README.md and docs/*.md -> the pages that hold it."""
  found = {}
  for page in pages():
    for command in bash_commands(page.read_text()):
      found.setdefault(command, []).append(str(page.relative_to(ROOT)))
  return found


def manifest() -> dict:
  return json.loads(MANIFEST.read_text())


def test_the_manifest_lists_exactly_the_commands_of_the_docs():
  found, listed = documented(), manifest()
  missing = {command: where for command, where in found.items() if command not in listed}
  stale = [command for command in listed if command not in found]
  assert not missing, ("commands in the docs that docs/commands.json does not list; add each with "
                       '{"run_by": "tests/test_x.py::test_name"} or {"not_run": "why"}:\n'
                       + "\n".join(f"  {where[0]}: {command}" for command, where in missing.items()))
  assert not stale, ("docs/commands.json lists commands no page holds any more; remove them:\n"
                     + "\n".join(f"  {command}" for command in stale))


def test_each_entry_is_run_by_a_test_or_says_why_not():
  for command, entry in manifest().items():
    assert set(entry) - {"resumes"} in ({"run_by"}, {"not_run"}, {"not_run", "closest"}), (
        f"{command!r}: an entry is {{\"run_by\": TEST}} or {{\"not_run\": WHY}} (with \"closest\": TEST "
        f"and \"resumes\": WHY optional), not {entry}")
    assert all(isinstance(value, str) and value.strip() for value in entry.values()), f"{command!r}: {entry}"


def functions_in(path: Path) -> set[str]:
  """`name` for each module-level test function of `path`, and `Class::name` for each method."""
  tree = ast.parse(path.read_text())
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      names.add(node.name)
    elif isinstance(node, ast.ClassDef):
      names |= {f"{node.name}::{item.name}" for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
  return {name for name in names if name.split("::")[-1].startswith("test")}


def test_every_named_test_exists():
  wrong = []
  for command, entry in manifest().items():
    for key in ("run_by", "closest"):
      if key not in entry:
        continue
      path, _, name = entry[key].partition("::")
      if not (path.startswith("tests/") and (ROOT / path).is_file() and name in functions_in(ROOT / path)):
        wrong.append(f"  {key} {entry[key]!r} ({command.splitlines()[0]})")
  assert not wrong, ("docs/commands.json names tests that do not exist (renamed or removed?); "
                     "name one as tests/test_x.py::test_name:\n" + "\n".join(wrong))


@pytest.mark.parametrize("command", RUN_HERE)
def test_quick_commands_run_as_written(command):
  assert command in documented(), f"{command!r} is no longer in the docs: update RUN_HERE"
  assert manifest()[command] == {"run_by": f"tests/test_docs.py::{test_quick_commands_run_as_written.__name__}"}
  env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
  result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0 and result.stdout.strip(), result.stdout[-2000:] + result.stderr[-2000:]


def relative_links(markdown: str) -> list[str]:
  """The targets of the markdown links and images in `markdown` outside code, without a URL scheme."""
  prose = re.sub(r"^\s*```.*?^\s*```", "", markdown, flags=re.DOTALL | re.MULTILINE)
  prose = re.sub(r"`[^`\n]*`", "", prose)
  targets = re.findall(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
  return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.IGNORECASE) and not t.startswith("#")]


def test_every_relative_link_reaches_a_file():
  broken = []
  for page in pages():
    for target in relative_links(page.read_text()):
      if not (page.parent / target.split("#")[0]).exists():
        broken.append(f"  {page.relative_to(ROOT)}: {target}")
  assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_readme_is_a_front_page():
  lines = len((ROOT / "README.md").read_text().splitlines())
  assert lines <= README_MAX_LINES, (
      f"README.md has {lines} lines, more than {README_MAX_LINES}: move a feature's text into its page in docs/")


def modules() -> set[str]:
  """The top-level scripts and every module of the top-level packages the code map covers."""
  found = {path.name for path in ROOT.glob("*.py") if path.name not in ("setup.py", "conftest.py")}
  for package in ROOT.iterdir():
    if package.is_dir() and package.name not in NOT_MAPPED and (package / "__init__.py").is_file():
      found |= {str(path.relative_to(ROOT)) for path in package.rglob("*.py")
                if path.name != "__init__.py" and "__pycache__" not in path.parts}
  return found


def code_map() -> str:
  readme = (ROOT / "README.md").read_text()
  assert "\n## Code map\n" in readme, "README.md has no '## Code map' section"
  return readme.split("\n## Code map\n", 1)[1].split("\n## ", 1)[0]


def test_the_code_map_names_every_module_and_no_other():
  named = {path for path in re.findall(r"(?<![\w/.])((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b", code_map())
           if not path.endswith("__init__.py")}
  present = modules()
  unnamed, gone = sorted(present - named), sorted(p for p in named if not (ROOT / p).is_file())
  assert present, "found no modules: has the tree moved?"
  assert not unnamed, ("README's code map does not name these modules; add a line each saying its job:\n  "
                       + "\n  ".join(unnamed))
  assert not gone, "README's code map names files that do not exist (moved or renamed?):\n  " + "\n  ".join(gone)


def training_workdir(command: str) -> str | None:
  """The workdir a documented command trains into (train.py's, or train.py's under tools/launch.py),
  as train.py names it; None for a command that trains nothing (a dry run, another tool)."""
  words = shlex.split(command.split("\n")[0])
  if "train.py" not in words or "--dry_run" in words:
    return None
  flags = words[words.index("train.py") + 1:]
  given = [flag.split("=", 1)[1] for flag in flags if flag.startswith("--config.workdir=")]
  return os.path.normpath(given[-1] if given else default_workdir(flags))


def test_no_two_documented_runs_share_a_workdir_unless_one_resumes_the_other():
  # A newcomer runs the pages' commands in order; a second run in the first one's workdir resumes it,
  # or refuses its checkpoint, or finds nothing to train. Each page's resumes say so in the manifest.
  # The processes of one multi-host run differ only in their ids.
  one_run = lambda command: re.sub(r"--config\.distributed\.process_id=\d+|\s*&$", "", command)
  first, shared = {}, []
  for command in documented():
    workdir = training_workdir(command)
    if workdir is None:
      continue
    if workdir in first and one_run(command) != one_run(first[workdir]) and "resumes" not in manifest()[command]:
      shared.append(f"  {workdir}:\n    {first[workdir]}\n    {command}")
    first.setdefault(workdir, command)
  assert not shared, ("documented commands that train into the same workdir, the later not marked as a resume "
                      "in docs/commands.json (\"resumes\": WHY); give one its own --config.workdir:\n"
                      + "\n".join(shared))
