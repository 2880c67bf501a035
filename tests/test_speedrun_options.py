"""The modded-nanogpt speedrun's model options, off by default, any family: ReLU-squared in the MLP
(model.activation=relu2) and zero-initialised output projections (model.zero_init_out). Each computes what it says,
and a run with both trains on data x tensor and under ZeRO-3 as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_tree_close, params_after_steps, tiny_config
from interop import hf_mapping
from model.config import ACTIVATION_NAMES
from model.layers import ACTIVATIONS
from model.mlp import Mlp
from training.state import build_model, model_config

SPEEDRUN = {"model.activation": "relu2", "model.zero_init_out": True}
# The zeroed projections, and through them the weights before them, take their first updates from gradients near
# zero, which Adam normalises: the layouts' summation-order differences (1e-7 relative) reach 2.5e-5 of a weight's
# largest entry after three steps (measured), as LoRA's B, which starts at zero, does (tests/test_lora.py). A layout
# that lost a reduction would be off by its factor (0.5 and more).
ZERO_START_TOLERANCE = 1e-4
FAMILIES = {"gpt2": {}, "llama": {"model.family": "llama", "model.kv_heads": 2}}


def test_every_activation_name_has_its_function():
  assert tuple(ACTIVATIONS) == ACTIVATION_NAMES


@pytest.mark.parametrize("family", FAMILIES)
def test_relu2_squares_the_rectified_mlp_input(family):
  cfg = model_config(tiny_config(**FAMILIES[family], **{"model.activation": "relu2"}))
  with nnx.use_eager_sharding(False):
    mlp = Mlp(cfg, nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.embed_dim))
  relu2 = lambda h: np.maximum(h, 0) ** 2
  if cfg.traits.gated_mlp:  # relu2(x W_gate) * (x W_up), then W_down
    hidden = relu2(x @ mlp.gate_kernel[...]) * (x @ mlp.up_kernel[...])
    expected = hidden @ mlp.down_kernel[...]
  else:
    expected = relu2(x @ mlp.up_kernel[...] + mlp.up_bias[...]) @ mlp.down_kernel[...] + mlp.down_bias[...]
  np.testing.assert_allclose(mlp(x), expected, rtol=1e-5, atol=1e-6)
  with nnx.use_eager_sharding(False):
    family_own = Mlp(model_config(tiny_config(**FAMILIES[family])), nnx.Rngs(0))(x)
  assert np.abs(family_own - expected).max() > 1e-3 * np.abs(expected).max()  # another function than the family's


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_init_out_zeroes_the_residual_projections_alone(family):
  def initial(**options):
    cfg = model_config(tiny_config(**FAMILIES[family], **options, **{"moe.experts": 4}))
    with nnx.use_eager_sharding(False):
      return nnx.to_pure_dict(nnx.state(build_model(cfg, 0), nnx.Param))
  zeroed, default = initial(**{"model.zero_init_out": True}), initial()
  for (path, z), d in zip(jax.tree_util.tree_leaves_with_path(zeroed), jax.tree.leaves(default)):
    name = str(path[-1].key)
    if name in ("out_kernel", "down_kernel"):  # the attention's output, the (experts') MLP's down projection
      assert not np.any(z) and np.any(d), name
    else:  # the same draws as without the option: only the projections into the residual stream change
      np.testing.assert_array_equal(z, d, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def one_device():
  return params_after_steps({**SPEEDRUN, "mesh.data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("layout", [{"mesh.data": 4, "mesh.tensor": 2}, {"mesh.data": 8, "sharding.zero": 3}],
                         ids=["data x tensor", "zero-3"])
def test_a_speedrun_model_trains_as_on_one_device(one_device, layout):
  # Three steps: the zeroed projections grow from the first update, and the kernels before them then get gradients.
  assert_tree_close(params_after_steps({**SPEEDRUN, **layout}, jax.devices()), one_device, f"params, {layout}",
                    ZERO_START_TOLERANCE)
  out = one_device["blocks"]["attn"]["out_kernel"]
  assert np.abs(out).max() > 0  # trained away from zero: the equality covers a live model


def test_an_unknown_activation_is_refused_and_relu2_is_not_exported_as_gelu():
  with pytest.raises(ValueError, match=r"model.activation='swish' is unknown; use one of gelu, silu, relu2"):
    model_config(tiny_config(**{"model.activation": "swish"}))
  with pytest.raises(ValueError, match=r"model.activation='relu2': the config.json meshlm writes for gpt2 names its "
                                       "own gelu"):
    hf_mapping.hf_config(model_config(tiny_config(**SPEEDRUN)), tied=True)
  assert jnp.array_equal(ACTIVATIONS["relu2"](jnp.array([-2.0, 3.0])), jnp.array([0.0, 9.0]))
