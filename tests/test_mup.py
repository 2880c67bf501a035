"""muP (model/mup.py): the coordinate check, the parametrisation's scales, layouts and refusals.

The coordinate check trains widths 32, 64 and 128 (heads of 16) for three AdamW steps at one learning rate
and reads the RMS of the last block's output and of the logits: under the standard parametrisation the
block's output grows with the width (8.2x from 32 to 128 here), under muP it stays within 1.5x, and so do
the logits. Layouts: float32, parameters after STEPS steps within 1e-5 of one device's.
"""

import jax
import numpy as np
import pytest

from helpers import assert_params_close, params_after_steps, tiny_config
from run.loop import train
from measure.coordinates import check
from training.state import init_state, plan

WIDTHS = [32, 64, 128]


@pytest.fixture(scope="module")
def coordinates():
  return check(WIDTHS, lr=1e-2, steps=3)


def spread(by_width, which):
  """Largest over smallest coordinate size across the widths, after the last step."""
  last = [sizes[-1][which] for sizes in by_width.values()]
  return max(last) / min(last)


def test_coordinates_stay_flat_across_widths_under_mup_and_grow_without(coordinates):
  assert spread(coordinates["muP"], 0) < 1.5 and spread(coordinates["muP"], 1) < 1.5, coordinates["muP"]
  standard = coordinates["standard"]
  assert spread(standard, 0) > 3, standard
  assert all(standard[a][-1][0] < standard[b][-1][0] for a, b in zip(WIDTHS, WIDTHS[1:])), standard


def test_the_base_width_is_the_standard_parametrisation():
  # m = 1: nothing scales, so muP at its base width trains exactly as the standard parametrisation.
  standard = params_after_steps({"mesh.data": 1}, jax.devices()[:1])
  at_base = params_after_steps({"mesh.data": 1, "mup.base_width": 64}, jax.devices()[:1])
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(at_base), jax.tree.leaves(standard)))


def test_wide_initialisation_and_learning_rates_follow_the_width():
  # Width 256 against a base of 64 (m = 4): hidden matrices start at std 0.02 / 2, the token table at 0.02.
  config = tiny_config(**{"model.embed_dim": 256, "model.num_heads": 16, "model.mlp_dim": 1024,
                          "mup.base_width": 64})
  layout = plan(config, jax.devices()[:1])
  params = jax.device_get(init_state(layout, 0)["params"])
  assert abs(params["blocks"]["mlp"]["up_kernel"].std() - 0.01) < 5e-4
  assert abs(params["embed"]["tokens"][:256].std() - 0.02) < 5e-4
  assert layout.model.output_multiplier == 0.25


MUP = {"mup.base_width": 32, "model.embed_dim": 64}


MESHES = {"gpt2": {"mesh.data": 4, "mesh.tensor": 2, "sharding.zero": 3},
          "llama": {"mesh.data": 2, "mesh.pipeline": 2, "mesh.sequence": 2}}


@pytest.mark.parametrize("family", MESHES)
def test_a_mup_model_on_a_mesh_matches_one_device(family):
  mesh = MESHES[family]
  overrides = {**MUP, "model.family": family}
  reference = params_after_steps({**overrides, "mesh.data": 1}, jax.devices()[:1])
  params = params_after_steps({**overrides, **mesh}, jax.devices())
  assert_params_close(params, reference, f"{family} under muP on {mesh}")


@pytest.mark.parametrize("overrides, says", [
    ({"mup.base_width": 48}, r"^mup.base_width=48 must divide model.embed_dim=64 into a base model of whole heads "
                             r"as wide as these \(model.num_heads=4\), e.g. 16; or leave it at 0"),
    ({"mup.base_width": 8}, r"^mup.base_width=8 must divide model.embed_dim=64 into a base model of whole heads"),
    ({"mup.base_width": 16, "optimizer.name": "muon"}, r"^mup.base_width=16 scales Adam's learning rates; "
                                                       r"optimizer.name='muon' would need its own"),
    ({"mup.base_width": 16, "moe.experts": 4}, r"^mup.base_width=16 with moe.experts=4: muP for the router and "
                                               r"experts is not built"),
])
def test_bad_mup_settings_are_refused_in_one_line(tmp_path, overrides, says):
  config = tiny_config(**{**overrides, "workdir": str(tmp_path / "run"), "model.embed_dim": 64})
  with pytest.raises(ValueError, match=says) as raised:
    train(config)
  assert "\n" not in str(raised.value)
  assert not (tmp_path / "run").exists()
