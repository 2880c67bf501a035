"""LoRA (training/lora.py): adapters merged as W + (alpha / rank) A B, the frozen weights untouched, and every mesh
layout training the adapters as one device does."""

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import (assert_tree_close, batch_at, pair_chunks, read_metrics, run_reference, setup, tiny_config,
                     train_steps)
from input_pipeline import data, token_files
from interop.export import export
from model.placement import placed
from parallel import placement
from run.loop import train
from training import lora
from training.checkpoint import Checkpoints
from run.saved_run import from_checkpoint
from training.state import plan, trained_count
from training.step import loss_fn, make_train_step, model_weights
from training.validate import check_run

ADAPTED = {"lora.rank": 4, "lora.targets": "attention,mlp"}
# B starts at zero, so its first updates are Adam's m / sqrt(v) of gradients that differ between layouts only in
# their summation order (1e-7 relative): normalised, those differences reach 2.5e-5 of the adapters' largest
# entry after three steps (measured), where a weight trained from its initial value stays within 1e-5. A layout
# that lost a reduction would be off by its factor (0.5 and more).
ADAPTER_TOLERANCE = 1e-4


def adapters_after_steps(overrides, devices, steps=3):
  """(the state's frozen params and adapters after `steps` train steps, the fresh params) on the layout."""
  config, layout, state, _ = setup({**ADAPTED, **overrides}, devices)
  before = jax.device_get(state["params"])
  after = jax.device_get(train_steps(config, layout, state, steps))
  return after["params"], after[lora.ADAPTERS], before


@pytest.fixture(scope="module")
def one_device():
  return adapters_after_steps({"mesh.data": 1}, jax.devices()[:1])


def test_merged_is_the_weight_plus_the_scaled_product_of_its_factors():
  config = tiny_config(**ADAPTED, **{"lora.alpha": 8.0, "moe.experts": 4})  # experts' kernels lead by two axes
  layout = plan(config, jax.devices()[:1])
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), layout.abstract_state["params"])
  adapters = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32),
                          layout.abstract_state[lora.ADAPTERS])
  merged = jax.device_get(lora.merged(layout.lora, params, adapters))
  layer = params["blocks"]["layers"][0]
  qkv, up = layer["attn"]["qkv_kernel"], layer["mlp"]["up_kernel"]  # [L, D, 3, H, K]; [L, E, D, F]
  pair = adapters["blocks"]["layers"][0]["attn"]["qkv_kernel"]
  np.testing.assert_allclose(merged["blocks"]["layers"][0]["attn"]["qkv_kernel"],
                             qkv + 2.0 * np.einsum("ldr,lrthk->ldthk", pair[lora.A], pair[lora.B]), rtol=1e-5, atol=1e-5)
  pair = adapters["blocks"]["layers"][0]["mlp"]["up_kernel"]
  np.testing.assert_allclose(merged["blocks"]["layers"][0]["mlp"]["up_kernel"],
                             up + 2.0 * np.einsum("ledr,lerf->ledf", pair[lora.A], pair[lora.B]), rtol=1e-5, atol=1e-5)
  out, pair = layer["attn"]["out_kernel"], adapters["blocks"]["layers"][0]["attn"]["out_kernel"]  # [L, H, K, D]
  np.testing.assert_allclose(merged["blocks"]["layers"][0]["attn"]["out_kernel"],
                             out + 2.0 * np.einsum("lhkr,lrd->lhkd", pair[lora.A], pair[lora.B]), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(merged["embed"]["tokens"], params["embed"]["tokens"])  # not a target


def test_a_run_starts_at_its_base_and_trains_only_the_adapters(one_device):
  config, layout, state, batch = setup({**ADAPTED, "mesh.data": 1}, jax.devices()[:1])
  base = tiny_config(**{"mesh.data": 1})
  base_layout = plan(base, jax.devices()[:1])
  at_start = jax.jit(lambda s, b: loss_fn(layout, model_weights(layout, s), b))(state, batch)
  plain = jax.jit(lambda p, b: loss_fn(base_layout, p, b))(state["params"], batch_at(base, base_layout, 0))
  assert float(at_start) == float(plain)  # B starts at zero: exactly the base model
  frozen, adapters, before = one_device
  jax.tree.map(np.testing.assert_array_equal, frozen, before)
  assert all(np.abs(pair[lora.B]).max() > 0 for pair in jax.tree.leaves(
      adapters, is_leaf=lambda x: isinstance(x, dict) and lora.B in x))
  # The optimizer's moments are the adapters' (two per element), not the model's.
  moments = sum(x.size for x in jax.tree.leaves(layout.abstract_state["opt_state"]) if x.ndim)
  assert moments == 2 * trained_count(layout) < sum(x.size for x in jax.tree.leaves(state["params"]))


@pytest.mark.parametrize("overrides", [{"mesh.data": 4, "mesh.tensor": 2}, {"mesh.data": 8, "sharding.zero": 3},
                                       {"mesh.data": 2, "mesh.sequence": 2, "mesh.tensor": 2,
                                        "attention.context": "ring"}],
                         ids=["data x tensor", "zero-3", "data x sequence x tensor"])
def test_adapters_train_as_on_one_device(one_device, overrides):
  _, adapters, _ = adapters_after_steps(overrides, jax.devices())
  assert_tree_close(adapters, one_device[1], f"adapters, {overrides}", ADAPTER_TOLERANCE)


def test_expert_adapters_train_as_on_one_device():
  experts = {"moe.experts": 4}
  _, expected, _ = adapters_after_steps({**experts, "mesh.data": 1}, jax.devices()[:1])
  _, adapters, _ = adapters_after_steps({**experts, "mesh.data": 2, "mesh.expert": 4}, jax.devices())
  assert_tree_close(adapters, expected, "expert adapters on data x expert", ADAPTER_TOLERANCE)


def test_a_bfloat16_base_halves_the_frozen_matrices_and_trains_as_on_one_device():
  narrow = {"lora.frozen_dtype": "bfloat16"}
  config, layout, state, batch = setup({**ADAPTED, **narrow, "mesh.data": 1}, jax.devices()[:1])
  dtypes = {x.ndim >= 2: x.dtype for x in jax.tree.leaves(state["params"])}
  assert dtypes == {True: jax.numpy.bfloat16, False: np.float32}  # matrices narrowed, norm scales and biases not
  assert {x.dtype for x in jax.tree.leaves(state[lora.ADAPTERS])} == {np.dtype(np.float32)}
  # The run starts at exactly the base model rounded to bfloat16.
  base_layout = plan(tiny_config(**{"mesh.data": 1}), jax.devices()[:1])
  rounded = jax.tree.map(lambda p: p.astype(np.float32), state["params"])
  at_start = jax.jit(lambda s, b: loss_fn(layout, model_weights(layout, s), b))(state, batch)
  assert float(at_start) == float(jax.jit(lambda p, b: loss_fn(base_layout, p, b))(rounded, batch))
  _, expected, _ = adapters_after_steps({**narrow, "mesh.data": 1}, jax.devices()[:1])
  _, adapters, _ = adapters_after_steps({**narrow, "mesh.data": 4, "mesh.tensor": 2}, jax.devices())
  assert_tree_close(adapters, expected, "adapters on a bfloat16 base, data x tensor", ADAPTER_TOLERANCE)


def test_a_lora_checkpoint_leaves_out_the_frozen_weights_and_resumes_exactly(tmp_path):
  workdir = str(tmp_path / "run")
  overrides = {**ADAPTED, "workdir": workdir, "steps": 4, "checkpoint.every": 2, "eval_every": 0,
               "sample_tokens": 0, "mesh.data": 4, "mesh.tensor": 2}
  train(tiny_config(**overrides))
  checkpoints = Checkpoints(workdir, every=0, keep=None)
  held = checkpoints._manager.item_metadata(4)["state"]  # pylint: disable=protected-access
  checkpoints.close()
  assert lora.ADAPTERS in held and "params" not in held
  last = lambda: [(r["loss"], r["grad_norm"]) for r in read_metrics(workdir) if r.get("step") == 4 and "loss" in r]
  straight = last()
  train(tiny_config(**overrides, resume="2"))  # the frozen weights drawn again from the seed, checked; step 4 redone
  assert len(straight) == 1 and last() == straight
  with pytest.raises(ValueError, match=r"holds LoRA adapters trained on other frozen weights than the ones given"):
    train(tiny_config(**{**overrides, "seed": 1}, resume="2"))


@pytest.mark.parametrize("overrides, message", [
    ({"lora.targets": "attention,ffn"}, r"lora.targets='attention,ffn' names \['ffn'\]"),
    ({"lora.alpha": 0.0}, r"lora.alpha=0.0 must be a finite number > 0"),
    ({"mesh.pipeline": 2}, r"lora.rank=4 with mesh.pipeline=2"),
    ({"moe.bias_rate": 0.01}, r"lora.rank=4 with moe.bias_rate=0.01"),
    ({"lora.frozen_dtype": "int4"}, r"lora.frozen_dtype='int4' is not one of float32, bfloat16"),
    ({"lora.rank": 0, "lora.frozen_dtype": "bfloat16"}, r"lora.frozen_dtype='bfloat16' with lora.rank=0 freezes"),
])
def test_bad_lora_settings_are_refused_in_one_sentence(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    check_run(tiny_config(workdir=str(tmp_path / "run"), **{**ADAPTED, **overrides}))


def test_dpo_with_adapters_takes_the_frozen_weights_as_its_reference(tmp_path):
  token_files.write_token_folder(tmp_path / "pairs", pair_chunks(0, 20, vocab=256), tokenizer="byte", vocab_size=256,
                                 val_fraction=0.1, masked=True, pairs=True)
  config, layout, state, _ = setup({**ADAPTED, "mesh.data": 2, "mesh.tensor": 2, "objective": "dpo",
                                    "data.source": "tokens", "data.path": str(tmp_path / "pairs")}, jax.devices()[:4])
  assert "reference" not in state
  split = data.open_split(config.data, "train", vocab_size=256)
  step = make_train_step(layout, config)
  for i in range(2):
    batch = data.global_batch(split, seed=0, step=i, batch_size=config.batch_size, seq_len=layout.model.max_len,
                              sharding=layout.batch_sharding)
    state, metrics = step(state, batch)
    if i == 0:  # the adapters start at zero: the policy is its reference, every pair's loss log 2
      np.testing.assert_allclose(float(metrics["loss"]), np.log(2), rtol=1e-6)
  assert float(metrics["loss"]) != float(np.log(2)) and float(metrics["dpo_margin"]) != 0


# Two of tests/test_hf_checkpoint.py's shapes: GPT-2's fused q/k/v (Conv1D, stored (in, out)) and Llama's
# grouped-query projections and SwiGLU (nn.Linear, stored (out, in)).
PEFT_MODELS = {"gpt2": dict(vocab_size=300, n_positions=32, n_embd=64, n_layer=2, n_head=4, n_inner=128),
               "llama": dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)}


@pytest.mark.parametrize("family", PEFT_MODELS)
def test_an_adapter_exported_for_peft_gives_meshlm_logits(family, tmp_path):
  base = tmp_path / "base"
  run_reference([{"make": family, "dir": str(base), "config": PEFT_MODELS[family], "seed": 0, "save": {}}], tmp_path)
  overrides = {**ADAPTED, "init_from": f"hf:{base}", "workdir": str(tmp_path / "run"), "steps": 4,
               "optimizer.lr": 0.02, "eval_every": 0, "sample_tokens": 0, "model.max_len": 32}
  train(tiny_config(**overrides))
  print(export(str(tmp_path / "run"), str(tmp_path / "adapter"), adapter=True))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
  np.save(tmp_path / "tokens.npy", tokens)
  run_reference([{"peft": str(base), "adapter": str(tmp_path / "adapter"), "tokens": str(tmp_path / "tokens.npy"),
                  "out": str(tmp_path / "peft.npy")},
                 {"logits": str(base), "tokens": str(tmp_path / "tokens.npy"), "out": str(tmp_path / "base.npy")}],
                tmp_path)
  _, layout, params, _, _ = from_checkpoint(str(tmp_path / "run"))
  ours = np.asarray(jax.jit(lambda p, t: nnx_predict(layout, p, t))(params, tokens))[..., :300]
  theirs, plain = np.load(tmp_path / "peft.npy"), np.load(tmp_path / "base.npy")
  scale = np.abs(theirs).max()
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * scale)
  assert np.abs(theirs - plain).max() > 100 * 1e-5 * scale  # the adapters moved the logits: the check has teeth


def nnx_predict(layout, params, tokens):
  with placed(placement.for_layout(layout)):
    return nnx.merge(layout.graphdef, params).predict(tokens)
