"""The feed-forward layer's second half, down(act(h)) (model/layers.py activated_down): under
model.recompute_activation, the default, the backward pass keeps only the activation's input (SwiGLU's gate
and up) and makes the activation, its derivative and the down projection's input again. Against plain
autodiff of the same layer (recompute_activation=False), for GPT-2's MLP, Llama's SwiGLU and the experts of
both, whose feed-forward layers run the same helper."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from configs.gpt2 import get_config
from helpers import make_train_step, setup, tiny_config
from measure import saved_for_backward
from model.mlp import Mlp
from model.moe import MoE
from training.state import model_config

D, F, E = 64, 256, 4  # helpers.tiny_config's width and MLP width; experts
TORCH_COMPILE_UNITS = 17.04  # BENCHMARKS.md: what torch.compile's partitioner keeps of a GPT-2 124M layer
# (family, experts' overrides): the dense layers, the experts on capacity slots, and dropless grouped experts
LAYERS = {"gelu": ("gpt2", {}), "swiglu": ("llama", {}),
          "gelu-experts": ("gpt2", {"moe.experts": E}), "swiglu-experts": ("llama", {"moe.experts": E}),
          "gelu-dropless": ("gpt2", {"moe.experts": E, "moe.dropless": True}),
          "swiglu-dropless": ("llama", {"moe.experts": E, "moe.dropless": True})}


def layer(name: str, compute: str, recompute: bool):
  """(parameters, the layer as a function of (parameters, x), cfg): every parameter moved off its initial
  value (the biases start at zero) by the same draw whatever `recompute` is."""
  family, experts = LAYERS[name]
  cfg = model_config(tiny_config(**{"model.family": family, "precision.compute": compute,
                                    "model.recompute_activation": recompute, **experts}))
  module = MoE if experts else Mlp
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(module(cfg, nnx.Rngs(0)))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(tree, [p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])

  def run(params, x):
    module = nnx.merge(graphdef, params)
    return module(x, jnp.arange(x.shape[1]))[0] if experts else module(x)

  return params, run, cfg


def pullback(name, compute, recompute):
  """The layer's output and the gradients of <output, g> by its parameters and its input x (which makes h,
  through the up projection), as float32 numpy arrays."""
  params, run, cfg = layer(name, compute, recompute)
  kx, kg = jax.random.split(jax.random.key(2))
  x = jax.random.normal(kx, (2, 32, D)).astype(cfg.dtype)
  g = jax.random.normal(kg, (2, 32, D))
  objective = lambda params, x: jnp.vdot(run(params, x).astype(jnp.float32), g)
  out, grads = jax.jit(lambda *a: (run(*a), jax.grad(objective, argnums=(0, 1))(*a)))(params, x)
  return jax.tree.map(lambda a: np.asarray(a, np.float32), (out, grads))


def relative_error(actual, expected):
  return np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("compute, tolerance", [("float32", 1e-6), ("bfloat16", 1e-2), ("float8", 1e-2)])
def test_gradients_equal_plain_autodiff(name, compute, tolerance):
  if compute == "float8" and name.endswith("dropless"):
    pytest.skip("dropless experts have no fp8 path (model/config.py refuses it)")
  (out, grads), (expected_out, expected_grads) = pullback(name, compute, True), pullback(name, compute, False)
  assert relative_error(out, expected_out) <= tolerance
  expected = dict(jax.tree_util.tree_leaves_with_path(expected_grads))
  names = {jax.tree_util.keystr(path) for path in expected}
  # x's gradient, both kernels, and the biases where the family has them
  assert {"[1]", "[0]['up_kernel'].value", "[0]['down_kernel'].value"} <= names
  assert ("[0]['up_bias'].value" in names) == name.startswith("gelu")
  for path, actual in jax.tree_util.tree_leaves_with_path(grads):
    assert relative_error(actual, expected[path]) <= tolerance, (jax.tree_util.keystr(path), compute)


def hidden_residuals(name: str, recompute: bool) -> int:
  """How many [..., F] values that grow with the tokens (not a weight's [.., D, F] cast) the bfloat16 layer
  keeps for its backward pass, as jax lists them."""
  params, run, cfg = layer(name, "bfloat16", recompute)
  listed = io.StringIO()
  with contextlib.redirect_stdout(listed):
    print_saved_residuals(run, params, jnp.zeros((3, 16, D), cfg.dtype))
  shapes = [tuple(int(n) for n in dims.split(",")) for dims in re.findall(r"^\w+\[([\d,]+)\]", listed.getvalue(), re.M)]
  return sum(shape[-1] == F and shape[-2] != D for shape in shapes)


@pytest.mark.parametrize("name", ["gelu", "swiglu", "gelu-experts", "swiglu-dropless"])
def test_only_the_activation_inputs_are_kept(name):
  # Differentiated as written, tanh-GELU keeps its input, three intermediates and its output; SwiGLU its
  # gate, SiLU's three values, the up projection and the product. Recomputed: the input (gate and up) alone.
  gated = name.startswith("swiglu")
  assert hidden_residuals(name, recompute=False) == (6 if gated else 5)
  assert hidden_residuals(name, recompute=True) == (2 if gated else 1)


def test_a_gpt2_124m_layer_keeps_less_than_torch_compile():
  # bfloat16, remat none, cuDNN attention counted by rule, as tools/saved_vs_torch.py measures it: the 16
  # units of tanh-GELU's four values (intermediates and output) are gone, 28.04 -> 12.04.
  config = get_config("124m")
  assert config.precision.compute == "bfloat16" and config.model.recompute_activation
  per_layer = lambda c: (b := saved_for_backward.budget(model_config(c), backend="gpu")).units(b.per_layer)
  folded = per_layer(config)
  config.model.recompute_activation = False
  assert round(per_layer(config), 2) == 28.04 and round(folded, 2) == 12.04 <= TORCH_COMPILE_UNITS


def test_unrolled_layers_compile_to_fewer_temporaries_too():
  # With the layers unrolled, the forward pass's act(h) and the backward pass's are in one program: unguarded,
  # XLA would merge them and keep act(h) until the backward pass, as much as autodiff keeps. Measured: about
  # two float32 [B, T, mlp] fewer per layer (four the scanned layers, tests/test_compute_options.py).
  def temporaries(recompute):
    config, layout, state, batch = setup({"model.scan_layers": False, "model.recompute_activation": recompute},
                                         jax.devices()[:1])
    return make_train_step(layout, config).lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  config = tiny_config()
  hidden = config.batch_size * config.model.max_len * config.model.mlp_dim * 4  # one float32 [B, T, mlp]
  dropped = (temporaries(False) - temporaries(True)) / (hidden * config.model.num_layers)
  assert dropped >= 1.5, dropped
