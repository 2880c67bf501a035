"""Both notebooks run top to bottom on 8 simulated CPU devices, shrunk by MESHLM_NOTEBOOK_QUICK, and their
install cell does on Colab what it says: clone a git URL or unpack an uploaded zip, then install it."""

import json
import os
import sys
import zipfile

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from helpers import ROOT

KERNEL = "meshlm-test"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
  """A kernel spec that runs this interpreter, and the environment the kernel inherits."""
  jupyter = tmp_path_factory.mktemp("jupyter")
  spec = jupyter / "kernels" / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "meshlm test", "language": "python"}))
  return {"JUPYTER_PATH": str(jupyter), "MESHLM_NOTEBOOK_QUICK": "1"}


def execute(name, env, runs, monkeypatch):
  for key, value in {**env, "MESHLM_RUNS": str(runs)}.items():
    monkeypatch.setenv(key, value)  # the kernel starts with this process's environment
  notebook = nbformat.read(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), as_version=4)
  NotebookClient(notebook, timeout=300, kernel_name=KERNEL,
                 resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
  return notebook


def outputs(cell, mime="text/plain"):
  texts = [o.get("text", "") for o in cell.outputs if o.output_type == "stream"]
  texts += [o.data.get(mime, "") for o in cell.outputs if o.output_type in ("execute_result", "display_data")]
  return "".join(texts)


def test_quickstart_trains_and_samples_on_a_data_x_tensor_mesh(kernel_env, tmp_path, monkeypatch):
  cells = [c for c in execute("quickstart_tpu", kernel_env, tmp_path, monkeypatch).cells if c.cell_type == "code"]
  assert "not on Colab" in outputs(cells[1])  # the install cell did nothing
  assert "8 x cpu" in outputs(cells[2]).lower()
  layout = outputs(cells[3])
  assert "'data': 4" in layout and "'tensor': 2" in layout and "P('pipeline', None, 'tensor')" in layout
  assert any("image/png" in o.get("data", {}) for o in cells[4].outputs)  # the loss plot
  assert "final loss" in outputs(cells[4])
  assert sum(line[1:].startswith("def ") for line in outputs(cells[5]).splitlines()) == 2  # two samples


def test_ablation_notebook_shows_table_and_figure(kernel_env, tmp_path, monkeypatch):
  cells = [c for c in execute("ablation", kernel_env, tmp_path, monkeypatch).cells if c.cell_type == "code"]
  table = outputs(cells[-2], "text/markdown")
  assert "| optimizer.name |" in table and "| adam_l2 |" in table and "| adamw |" in table
  assert any("image/png" in o.get("data", {}) for o in cells[-2].outputs)
  assert (tmp_path / "adamw_vs_l2" / "results.csv").exists()
  assert outputs(cells[-1]).count(": finished earlier") == 2  # the second sweep ran nothing


def install_cells(name):
  """The notebook's first two code cells: where meshlm comes from (a form) and the install cell."""
  notebook = nbformat.read(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), as_version=4)
  return [c.source for c in notebook.cells if c.cell_type == "code"][:2]


def run_as_on_colab(name, kernel_env, content, monkeypatch, repo_url=""):
  """Both cells as Colab runs them: google.colab importable, CONTENT in a temporary folder, and a `pip`
  first on PATH that records its arguments instead of installing. Returns the cells' output."""
  bin_dir = content / "bin"
  bin_dir.mkdir()
  (bin_dir / "pip").write_text(f'#!/bin/sh\necho "$@" > {content}/pip_args\n')
  (bin_dir / "pip").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
  form, install = install_cells(name)
  setup = ("import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')")
  as_colab = f"CONTENT = Path({str(content)!r})\nREPO_URL = {repo_url!r}"
  report = "print('ROOT', ROOT, 'cwd', os.getcwd())"
  notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in
                                             (setup, form, as_colab, install, report)])
  for key, value in kernel_env.items():
    monkeypatch.setenv(key, value)
  try:
    NotebookClient(notebook, timeout=120, kernel_name=KERNEL).execute()
  except CellExecutionError as error:
    return str(error)
  return "".join(outputs(cell) for cell in notebook.cells)


@pytest.mark.parametrize("name", ["quickstart_tpu", "ablation"])
def test_the_install_cell_clones_a_git_url_and_installs_it(name, kernel_env, tmp_path, monkeypatch):
  said = run_as_on_colab(name, kernel_env, tmp_path, monkeypatch, repo_url=str(ROOT))
  assert f"ROOT {tmp_path}/meshlm cwd {tmp_path}/meshlm" in said, said
  assert (tmp_path / "meshlm" / "train.py").exists()
  assert (tmp_path / "pip_args").read_text().split() == [
      "install", "-q", "-c", f"{tmp_path}/meshlm/constraints.txt", "-e", f"{tmp_path}/meshlm[research]"]


def test_the_install_cell_unpacks_an_uploaded_zip(kernel_env, tmp_path, monkeypatch):
  # GitHub's "Download ZIP" puts the tree in one folder, meshlm-main/.
  with zipfile.ZipFile(tmp_path / "meshlm.zip", "w") as upload:
    for name in ("train.py", "constraints.txt", "pyproject.toml"):
      upload.write(os.path.join(ROOT, name), f"meshlm-main/{name}")
  said = run_as_on_colab("quickstart_tpu", kernel_env, tmp_path, monkeypatch)
  assert f"ROOT {tmp_path}/meshlm cwd {tmp_path}/meshlm" in said, said
  assert sorted(os.listdir(tmp_path / "meshlm")) == ["constraints.txt", "pyproject.toml", "train.py"]


def test_the_install_cell_says_what_to_do_with_neither(kernel_env, tmp_path, monkeypatch):
  said = run_as_on_colab("quickstart_tpu", kernel_env, tmp_path, monkeypatch)
  assert "Set REPO_URL in the cell above" in said and f"{tmp_path}/meshlm.zip" in said, said
  assert not (tmp_path / "pip_args").exists()
