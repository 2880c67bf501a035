"""Options that change how the model computes, not what: `model.scan_layers=False` (the layers unrolled in
Python) and `model.recompute_activation=False` (the MLP differentiated as written, where the default keeps only
the activation's input and makes the rest again in the backward pass)."""

import jax
import pytest

from tests.helpers import LLAMA, assert_tree_close, loss_and_gradients, make_train_step, setup

MOE = {"moe.experts": 4, "moe.every": 2, "model.num_layers": 4}
CASES = [({"model.remat": "full"}, {}), (LLAMA, {"mesh.data": 2, "mesh.tensor": 2}),
         (MOE, {"mesh.data": 2, "mesh.expert": 2})]
IDS = ["gpt2-remat", "llama-data-tensor", "moe-data-expert"]


@pytest.mark.parametrize("option", [{"model.scan_layers": False}, {"model.recompute_activation": False}],
                         ids=["unrolled", "autodiff-activation"])
@pytest.mark.parametrize("overrides, mesh", CASES, ids=IDS)
def test_the_option_leaves_loss_and_gradients_as_they_were(option, overrides, mesh):
  devices = jax.devices()[:max(1, 2 * len(mesh))]
  ref_loss, ref_grads = loss_and_gradients({**overrides, **mesh}, devices)
  loss, grads = loss_and_gradients({**overrides, **mesh, **option}, devices)
  assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
  assert_tree_close(grads, ref_grads, f"{option} against the default's gradients")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_recomputed_activations_compile_to_fewer_temporaries(family):
  # GELU and SwiGLU each keep four [B, T, mlp] values fewer per layer (tests/test_mlp_backward.py counts them);
  # XLA fuses some of those away in the plain path too: the compiled step holds 3 (GELU) and 2.5 (SwiGLU) fewer.
  def temporaries(recompute):
    config, layout, state, batch = setup({"model.family": family, "model.recompute_activation": recompute},
                                         jax.devices()[:1])
    return make_train_step(layout, config).lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  config = setup({"model.family": family}, jax.devices()[:1])[0]
  hidden = config.batch_size * config.model.max_len * config.model.mlp_dim * 4  # one float32 [B, T, mlp]
  dropped = 4 * config.model.num_layers * hidden
  assert temporaries(False) - temporaries(True) >= dropped // 2, (family, dropped)
