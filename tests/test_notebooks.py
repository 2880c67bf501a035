"""Both notebooks run top to bottom on 8 simulated CPU devices, shrunk by MESHLM_NOTEBOOK_QUICK."""

import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
