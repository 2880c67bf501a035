"""The modded-nanogpt speedrun's model options, off by default, any family: ReLU-squared in the MLP
(model.activation=relu2), zero-initialised output projections (model.zero_init_out), U-net skips across the stack
(model.unet_skips), value embeddings (model.value_embeds) and an fp8 head (model.fp8_head). Each computes what it
says, and a run with all five trains on data x tensor and under ZeRO-3 as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_tree_close, params_after_steps, tiny_config
from interop import hf_mapping
from model.config import ACTIVATION_NAMES
from model.fp8 import fixed_scale_einsum, head_scales
from model.layers import ACTIVATIONS
from model.mlp import Mlp
from model.stack import unit_of
from model.value_embeds import layer_tables
from training.state import build_model, model_config, plan

SPEEDRUN = {"model.activation": "relu2", "model.zero_init_out": True, "model.unet_skips": True,
            "model.value_embeds": 1, "model.fp8_head": True, "model.qk_norm": True}
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


# Ring attention reorders the sequence over `sequence` (load balancing): the value rows must follow the tokens.
@pytest.mark.parametrize("layout", [{"mesh.data": 4, "mesh.tensor": 2}, {"mesh.data": 8, "sharding.zero": 3},
                                    {"mesh.data": 2, "mesh.tensor": 2, "mesh.sequence": 2, "attention.context": "ring"}],
                         ids=["data x tensor", "zero-3", "ring attention"])
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


def _built(**options):
  cfg = model_config(tiny_config(**options))
  with nnx.use_eager_sharding(False):
    return build_model(cfg, 0)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_unet_skips_add_the_first_halfs_outputs_back_in_reverse(scan_layers):
  model = _built(**{"model.num_layers": 4, "model.unet_skips": True, "model.scan_layers": scan_layers})
  model.unet.scale[...] = jnp.array([0.7, -1.3])
  x = jax.random.normal(jax.random.key(1), (2, 8, model.cfg.embed_dim))
  block = lambda i, x: unit_of(model.blocks, i)(x, jnp.arange(8))[0]
  h0 = block(0, x)
  h1 = block(1, h0)
  h2 = block(2, h1 + 0.7 * h1)  # the second half's first unit takes the first half's last output
  expected = block(3, h2 - 1.3 * h0)
  np.testing.assert_allclose(model.run_blocks(x)[0], expected, rtol=1e-5, atol=1e-5)
  assert np.abs(block(3, block(2, h1)) - expected).max() > 1e-2  # the skips change the output


def test_value_embeddings_name_the_first_and_last_layers_tables():
  cfg = lambda layers, k: model_config(tiny_config(**{"model.num_layers": layers, "model.value_embeds": k}))
  assert layer_tables(cfg(12, 3)) == (0, 1, 2, -1, -1, -1, -1, -1, -1, 0, 1, 2)  # modded-nanogpt's pattern
  assert layer_tables(cfg(2, 1)) == (0, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_value_embeddings_mix_the_tokens_rows_into_the_values(family):
  options = {**FAMILIES[family], "model.num_layers": 3}
  model, plain = _built(**options, **{"model.value_embeds": 1}), _built(**options)
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, model.cfg.vocab_size)
  loss = lambda model: float(model(tokens[:, :-1], tokens[:, 1:]))
  tables = model.value_embeds[...]
  np.testing.assert_array_equal(model.value_rows(tokens)[0], tables[0][tokens])
  mix = model.blocks.attn.value_mix.scale
  assert abs(loss(model) - loss(plain)) > 1e-4  # (1/2, 1/2) at the start: the rows change the loss
  mix[...] = jnp.array([[1.0, 0.0], [7.0, 7.0], [1.0, 0.0]])  # layer 1 has no table: its weights go unread
  assert loss(model) == pytest.approx(loss(plain), abs=1e-6)  # every other weight drawn as without the tables
  model.value_embeds[...] = jnp.zeros_like(tables)
  mix[...] = jnp.array([[2.0, 5.0], [1.0, 1.0], [1.0, 0.0]])  # zero rows and twice the values in layer 0 ...
  doubled = _built(**options)
  kernel = getattr(doubled.blocks.attn, "qkv_kernel" if family == "gpt2" else "v_kernel")
  if family == "gpt2":
    kernel[...] = kernel[...].at[0, :, 2].multiply(2.0)
    doubled.blocks.attn.qkv_bias[...] = doubled.blocks.attn.qkv_bias[...].at[0, 2].multiply(2.0)
  else:
    kernel[...] = kernel[...].at[0].multiply(2.0)
  assert loss(model) == pytest.approx(loss(doubled), abs=1e-5)  # ... are layer 0's value projection doubled


@pytest.mark.parametrize("family", FAMILIES)
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(family):
  options = {**FAMILIES[family], "model.num_layers": 1}
  model, plain = _built(**options, **{"model.qk_norm": True}), _built(**options)
  tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, model.cfg.vocab_size)
  loss = lambda model: float(model(tokens[:, :-1], tokens[:, 1:]))
  before, plain_before = loss(model), loss(plain)

  def scale_queries_and_keys(model):  # queries x 5, keys x 3, biases with them (the stacked weights' axis 0: layers)
    attn = model.blocks.attn
    if family == "gpt2":
      attn.qkv_kernel[...] = attn.qkv_kernel[...].at[:, :, 0].multiply(5.0).at[:, :, 1].multiply(3.0)
      attn.qkv_bias[...] = attn.qkv_bias[...].at[:, 0].multiply(5.0).at[:, 1].multiply(3.0)
    else:
      attn.q_kernel[...], attn.k_kernel[...] = attn.q_kernel[...] * 5.0, attn.k_kernel[...] * 3.0

  scale_queries_and_keys(model)
  scale_queries_and_keys(plain)
  assert loss(model) == pytest.approx(before, abs=1e-5)  # each head normalised: its scale is gone
  assert abs(loss(plain) - plain_before) > 1e-3  # without the norms the scores grow 15x
  model.blocks.attn.q_norm.scale[...] = jnp.full_like(model.blocks.attn.q_norm.scale[...], 4.0)
  assert abs(loss(model) - before) > 1e-3  # the learned gain sets the scores' scale instead


def test_the_new_options_refuse_what_they_cannot_do():
  with pytest.raises(ValueError, match=r"model.unet_skips pairs the first half .* it has 3 units; use an even"):
    model_config(tiny_config(**{"model.num_layers": 3, "model.unet_skips": True}))
  with pytest.raises(ValueError, match=r"model.value_embeds=2 must be a number of tables from 1 to half of "
                                       r"model.num_layers=2"):
    model_config(tiny_config(**{"model.value_embeds": 2}))
  with pytest.raises(ValueError, match=r"model.value_embeds=1 is built for a stack of single blocks"):
    model_config(tiny_config(**{"model.value_embeds": 1, "moe.experts": 4, "moe.every": 2}))
  for option, value in (("model.unet_skips", True), ("model.value_embeds", 1)):
    with pytest.raises(ValueError, match=rf"{option}={value}: its layers read values that other pipeline stages hold"):
      plan(tiny_config(**{option: value, "mesh.pipeline": 2, "pipeline.microbatches": 2}), jax.devices()[:2])
  with pytest.raises(ValueError, match=r"no transformers architecture for gpt2 has U-net skips, value embeddings "
                                       "or query and key norms"):
    hf_mapping.hf_config(model_config(tiny_config(**{"model.qk_norm": True})), tied=True)
  for family, why in (("qwen3", "normalises them its own way"), ("gemma2", "is its own")):
    with pytest.raises(ValueError, match=rf"model.qk_norm adds query and key norms to gpt2 and Llama-style attention, "
                                         rf"not to {family}, whose attention {why}; leave it off"):
      model_config(tiny_config(**{"model.family": family, "model.qk_norm": True}))


def test_the_fp8_head_rounds_each_entry_at_fixed_scales_and_saturates():
  x = jax.random.normal(jax.random.key(3), (4, 64))
  w = jax.random.normal(jax.random.key(4), (256, 64)) * 0.02
  scales = head_scales(64)
  exact = np.asarray(x @ w.T)
  fp8 = fixed_scale_einsum("td,vd->tv", x, w, scales)
  relative = np.abs(fp8 - exact).max() / np.abs(exact).max()
  assert 1e-3 < relative < 0.1  # E4M3 keeps 3 bits of mantissa: off by a few percent, not exact
  # Each entry rounds alone: a row's logits do not depend on the other rows (no maximum over the tensor).
  np.testing.assert_array_equal(fixed_scale_einsum("td,vd->tv", x[:1], w, scales), fp8[:1])
  huge = fixed_scale_einsum("td,vd->tv", x * 1e4, w, scales)  # past E4M3's 448 x the input's scale: saturated
  assert np.isfinite(huge).all()
  d_x, d_w = jax.grad(lambda x, w: fixed_scale_einsum("td,vd->tv", x, w, scales).sum(), argnums=(0, 1))(x, w)
  # A gradient of ones is exact in E5M2, so each sum is off by the operand's roundings alone: at most half an E4M3
  # step each, 1/16 of the entry, or half the smallest subnormal step (2^-9 of the scale) below E4M3's normals.
  rounding = lambda a, unscale: np.abs(a) / 16 + 2.0 ** -10 * unscale
  assert (np.abs(d_w - x.sum(0)) <= rounding(x, scales[0]).sum(0) + 1e-6).all()
  assert (np.abs(d_x - w.sum(0)) <= rounding(w, scales[1]).sum(0) + 1e-6).all()
  assert np.abs(d_w - x.sum(0)).max() > 1e-3  # and rounded: not float32's gradient
