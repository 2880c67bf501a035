"""One home per family (model/families.py): the registry builds every family, each family has a Hugging Face
mapping or a reason it has none, and a family added by one registry line is built, checked and refused by
name without another edit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from interop import hf_mapping
from model.config import ModelConfig
from model.families import FAMILIES
from model.layers import ACTIVATIONS
from model.mlp import Mlp
from model.transformer import LanguageModel
from training.state import build_model

SHAPE = dict(num_layers=2, num_heads=4, embed_dim=32, mlp_dim=64, max_len=16, vocab_size=100)
# A GeGLU family (Gemma's feed-forward layer) that is Llama in every other trait: one registry line.
GEGLU = dataclasses.replace(FAMILIES["llama"], activation="gelu")


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_builds_from_its_registry_line(name):
  family = FAMILIES[name]
  assert family.activation in ACTIVATIONS
  with nnx.use_eager_sharding(False):
    model = build_model(ModelConfig(family=name, **SHAPE), seed=0)
  assert isinstance(model, LanguageModel) and type(model).__name__ == family.model.split(".")[1]


def test_every_family_has_a_mapping_or_a_reason_and_every_mapping_a_family():
  mapped = {mapping.family for mapping in hf_mapping.MAPPINGS.values()}
  assert mapped <= FAMILIES.keys(), "a mapping names a family model/families.py does not register"
  assert hf_mapping.UNMAPPED.keys() <= FAMILIES.keys() - mapped, "UNMAPPED names a mapped or unknown family"
  assert all(hf_mapping.UNMAPPED.values()), "an unmapped family needs its reason"
  assert FAMILIES.keys() == mapped | hf_mapping.UNMAPPED.keys(), "a family without a mapping: add one or a reason"


def test_a_family_added_by_one_registry_line_builds_and_is_listed(monkeypatch):
  monkeypatch.setitem(FAMILIES, "geglu", GEGLU)
  with nnx.use_eager_sharding(False):
    model = build_model(ModelConfig(family="geglu", **SHAPE, num_experts=4), seed=0)
  logits = model.predict(jnp.zeros((1, 8), jnp.int32))
  assert logits.shape[:2] == (1, 8) and np.isfinite(np.asarray(logits)).all()
  with pytest.raises(ValueError,
                     match=r"unknown; use one of gpt2, llama, qwen2, qwen3, olmoe, gemma2, gemma3, deepseek3, geglu\.$"):
    ModelConfig(family="gemma9", **SHAPE)
  with pytest.raises(ValueError,
                     match=r"does not have; use 0, or one of llama, qwen2, qwen3, olmoe, gemma2, gemma3, deepseek3, "
                           r"geglu\.$"):
    ModelConfig(family="gpt2", **SHAPE, num_experts=4, moe_shared_width=8)


def test_an_unmapped_family_is_refused_export_with_its_reason(monkeypatch):
  monkeypatch.setitem(FAMILIES, "geglu", GEGLU)
  monkeypatch.setitem(hf_mapping.UNMAPPED, "geglu", "transformers' Gemma also scales its embeddings")
  with pytest.raises(ValueError, match=r"^meshlm's geglu has no Hugging Face architecture: transformers' Gemma "
                                       r"also scales its embeddings\.$"):
    hf_mapping.hf_config(ModelConfig(family="geglu", **SHAPE), tied=False)


def test_the_dense_feed_forward_applies_the_familys_activation_and_gate(monkeypatch):
  monkeypatch.setitem(FAMILIES, "geglu", GEGLU)
  cfg = ModelConfig(family="geglu", **SHAPE)
  with nnx.use_eager_sharding(False):
    layer = Mlp(cfg, nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.embed_dim))
  expected = (jax.nn.gelu(x @ layer.gate_kernel[...], approximate=True) * (x @ layer.up_kernel[...])
              @ layer.down_kernel[...])
  np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_export_names_the_families_that_hold_the_settings():
  with pytest.raises(ValueError, match=r"no Hugging Face architecture; export a llama \(MixtralForCausalLM: experts, "
                                       r"a window\), qwen3 \(Qwen3MoeForCausalLM: experts\) or olmoe "
                                       r"\(OlmoeForCausalLM: experts\) model\.$"):
    hf_mapping.hf_config(ModelConfig(family="gpt2", **SHAPE, num_experts=4), tied=False)
  with pytest.raises(ValueError, match=r"nor does any family with those settings; export a gpt2 \(GPT2LMHeadModel: "
                                       r"dense\), llama \(LlamaForCausalLM: dense\),"):
    hf_mapping.hf_config(ModelConfig(family="qwen2", **SHAPE, num_experts=4, moe_shared_width=8, sliding_window=4),
                         tied=False)
