"""Every model family, registered once: the class that builds it and what sets it apart.

The traits are read by whatever depends on them (model/config.py's checks, the feed-forward layer, the
estimator, interop/hf_mapping.py's Hugging Face mappings) instead of tests of the family's name, and every
refusal that lists families lists FAMILIES. Adding a family is its model file, its config in configs/, its
mapping in interop/hf_mapping.py and one line here.
"""

import dataclasses
import importlib

from flax import nnx


@dataclasses.dataclass(frozen=True)
class Family:
  """One family's registry entry: its model class and the traits the rest of the tree reads."""

  model: str  # "file.Class": the LanguageModel class in model/<file>.py that builds the family
  norm_eps: float  # the published normalisation epsilon
  activation: str  # the feed-forward activation, a name in model/layers.py ACTIVATIONS
  gated_mlp: bool  # three feed-forward matrices, act(x W_gate) * x W_up (SwiGLU with silu); otherwise two
  biases: bool  # the linear layers carry biases
  tied_head: bool  # the logits reuse the token table (vocab, embed); otherwise an (embed, vocab) head
  rotary: bool  # positions enter by rotating queries and keys (model.rope_*); otherwise a learned table
  qkv_bias: bool = False  # only the query, key and value projections carry biases (Qwen2)
  qk_norm: str = ""  # queries and keys RMS-normalised before rotary: each head ("head", Qwen3) or whole ("width", OLMoE)

  def build(self, cfg, rngs: nnx.Rngs) -> nnx.Module:
    # Imported by name when built: the model files import model/config.py, which checks names against FAMILIES.
    file, name = self.model.split(".")
    model = getattr(importlib.import_module(f"model.{file}"), name)(cfg, rngs)
    model.add_value_tables(rngs)  # drawn after the family's own weights, which then start as without them
    return model


_LLAMA = Family("llama.Llama", norm_eps=1e-6, activation="silu", gated_mlp=True, biases=False, tied_head=False,
                rotary=True)
FAMILIES = {
    "gpt2": Family("gpt2.GPT2", norm_eps=1e-5, activation="gelu", gated_mlp=False, biases=True, tied_head=True,
                   rotary=False),
    "llama": _LLAMA,
    "qwen2": dataclasses.replace(_LLAMA, model="qwen.Qwen", qkv_bias=True),
    "qwen3": dataclasses.replace(_LLAMA, model="qwen.Qwen", qk_norm="head"),
    "olmoe": dataclasses.replace(_LLAMA, model="olmoe.OLMoE", qk_norm="width"),
    "gemma2": dataclasses.replace(_LLAMA, model="gemma.Gemma", activation="gelu"),
    "gemma3": dataclasses.replace(_LLAMA, model="gemma.Gemma", activation="gelu", qk_norm="head"),
    # Llama's model; its latent attention and routing are options any family can set (mla.*, moe.*)
    "deepseek3": _LLAMA,
}
