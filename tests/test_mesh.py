"""The five-axis mesh from config, and refusals that name the bad size."""

import importlib

import pytest

from parallel.mesh import AXES, mesh_shape
from run.loop import train


def sizes(**given):
  return {axis: given.get(axis, 1) for axis in AXES}


def test_fill_takes_the_devices_left_over():
  assert mesh_shape(sizes(data=-1, tensor=2), 8) == sizes(data=4, tensor=2)
  assert mesh_shape(sizes(data=2, tensor=-1, expert=2), 8) == sizes(data=2, tensor=2, expert=2)


@pytest.mark.parametrize("given, says", [
    (sizes(data=3), "has 3 devices but 8 are present"),
    (sizes(data=-1, tensor=3), "does not divide 8"),
    (sizes(data=-1, tensor=-1), "only one mesh axis may be -1"),
    (sizes(data=0), "must be positive or -1"),
])
def test_bad_meshes_are_refused(given, says):
  with pytest.raises(ValueError, match=says):
    mesh_shape(given, 8)


@pytest.mark.parametrize("file, variant", [("llama", "tiny"), ("qwen", "qwen2_tiny"), ("qwen", "qwen3_tiny"),
                                           ("gemma", "gemma2_tiny")])
def test_kv_heads_the_tensor_axis_does_not_divide_are_refused_before_anything_is_written(tmp_path, file, variant):
  config = importlib.import_module(f"configs.{file}").get_config(variant)  # 4 heads, 2 key/value heads
  config.mesh.data, config.mesh.tensor, config.workdir = 2, 4, str(tmp_path / "run")
  with pytest.raises(ValueError, match=r"^model.kv_heads=2 is not divisible by mesh.tensor=4; choose sizes that "
                                       r"divide\.$"):
    train(config)
  assert not (tmp_path / "run").exists()
