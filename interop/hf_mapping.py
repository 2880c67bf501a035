"""Which Hugging Face tensor each meshlm weight is, and how config.json maps to `config.model`.

Conventions bridged here (no I/O; interop/hf_checkpoint.py reads and writes):
- Layout. GPT-2's Conv1D stores (in, out), meshlm's layout, so its weights only
  reshape; Llama's nn.Linear stores (out, in), so they also transpose.
- QKV. GPT-2 fuses Q, K and V in `c_attn` as [q | k | v] along the output,
  exactly meshlm's (embed, 3, heads, head_dim); Llama and Qwen keep q/k/v_proj
  apart, as meshlm's do. Nothing is split or fused in either direction.
- Qwen. Qwen2 and Qwen3 are Llama's tensors plus Qwen2's q/k/v_proj biases
  (heads x head_dim, flat in HF) or Qwen3's q_norm/k_norm gains (head_dim).
- Windows. Mistral is Llama with `sliding_window` (each query sees that many
  latest positions, its own included: model.sliding_window); null is none.
  Mixtral carries the same field.
- OLMoE is Llama with query and key RMS norms over their whole width (gains
  of heads x head_dim, flat in HF) and every layer's experts named as
  Qwen-MoE's.
- Experts. Mixtral is Llama, and Qwen3-MoE Qwen3, with every feed-forward layer
  a mixture of experts: one architecture per family and `moe.experts > 0`.
  Their files hold each expert's matrices apart (`experts.{expert}.w1`, or
  `gate_proj`), which meshlm stacks on its `expert` axis; the router's
  `gate` is (experts, width), meshlm's (width, experts). Both route as
  meshlm does: softmax over all experts, top k, then (Mixtral always,
  Qwen3-MoE where `norm_topk_prob`) the k weights renormalised; and both keep
  every choice, so import sets `moe.dropless`.
- Rotary. Hugging Face's Llama rotates (first half, second half) pairs of each
  head (`rotate_half`) with frequencies theta^(-i/half), which is what
  model/llama.py's `rotary` does, so q/k need no permutation. (The permutation
  in transformers' convert_llama_weights_to_hf.py turns Meta's interleaved
  pairs into halves; checkpoints on disk in HF format already have halves.)
- Vocabulary. meshlm pads the vocabulary to a multiple of 128 with zero rows
  that the loss masks out; import appends them and export drops them.
- Tied embeddings. meshlm's GPT-2 ties its head to the token table, so GPT-2's
  `lm_head` is never stored. meshlm's Llama has its own head: a tied Llama
  checkpoint fills it from the embedding (the two then train apart), and
  export writes it tied again while the two are still equal.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

from model.config import ModelConfig
from model.families import FAMILIES
from model.mtp import MTP
from model.stack import DENSE_STACKED, STACKED, dense_layers_config

TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")  # the two names transformers gives GPT-2's tanh GELU


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One meshlm weight as a Hugging Face tensor: reshape each HF axis into `split`, then transpose by `perm`.

  For a stacked block weight `name` holds `{layer}` and this is one layer's slice (and one expert's, for
  `per_expert`). In a unit of several blocks (model/transformer.py Unit) the stack's index is the unit's, and
  this block's Hugging Face layer is unit x unit_layers + unit_layer.
  """
  name: str
  split: tuple  # per HF axis, the sizes it splits into (an unsplit axis is a 1-tuple)
  perm: tuple  # meshlm axis i is axis perm[i] of the split view
  padded_axis: int | None = None  # the meshlm axis padded from vocab_size to padded_vocab
  per_expert: bool = False  # meshlm's first axis (after a stacked weight's layer) is the expert: `name` holds {expert}
  unit_layers: int = 1  # blocks per scanned unit
  unit_layer: int = 0  # this block's place in its unit
  first_layer: int = 0  # the Hugging Face layer of the stack's first unit (after moe.first_dense's dense layers)

  @property
  def hf_shape(self) -> tuple:
    return tuple(math.prod(sizes) for sizes in self.split)

  def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
    """The Hugging Face tensor of unit `layer` (stacked weights) and `expert` (an expert's matrices)."""
    hf_layer = None if layer is None else self.first_layer + layer * self.unit_layers + self.unit_layer
    return self.name.format(layer=hf_layer, expert=expert)


def _same(name: str, *shape) -> Tensor:
  return Tensor(name, tuple((size,) for size in shape), tuple(range(len(shape))))


def gpt2_tensors(cfg: ModelConfig, tied: bool) -> dict:
  del tied  # GPT-2's head is always its token table
  d, n, h, f, v = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  layer = "transformer.h.{layer}."
  return {
      ("embed", "tokens"): Tensor("transformer.wte.weight", ((v,), (d,)), (0, 1), padded_axis=0),
      ("embed", "positions"): _same("transformer.wpe.weight", cfg.max_len, d),
      ("blocks", "ln_attn", "scale"): _same(layer + "ln_1.weight", d),
      ("blocks", "ln_attn", "bias"): _same(layer + "ln_1.bias", d),
      ("blocks", "attn", "qkv_kernel"): Tensor(layer + "attn.c_attn.weight", ((d,), (3, n, h)), (0, 1, 2, 3)),
      ("blocks", "attn", "qkv_bias"): Tensor(layer + "attn.c_attn.bias", ((3, n, h),), (0, 1, 2)),
      ("blocks", "attn", "out_kernel"): Tensor(layer + "attn.c_proj.weight", ((n, h), (d,)), (0, 1, 2)),
      ("blocks", "attn", "out_bias"): _same(layer + "attn.c_proj.bias", d),
      ("blocks", "ln_mlp", "scale"): _same(layer + "ln_2.weight", d),
      ("blocks", "ln_mlp", "bias"): _same(layer + "ln_2.bias", d),
      ("blocks", "mlp", "up_kernel"): _same(layer + "mlp.c_fc.weight", d, f),
      ("blocks", "mlp", "up_bias"): _same(layer + "mlp.c_fc.bias", f),
      ("blocks", "mlp", "down_kernel"): _same(layer + "mlp.c_proj.weight", f, d),
      ("blocks", "mlp", "down_bias"): _same(layer + "mlp.c_proj.bias", d),
      ("ln_final", "scale"): _same("transformer.ln_f.weight", d),
      ("ln_final", "bias"): _same("transformer.ln_f.bias", d),
  }


# A mixture-of-experts architecture's names, within a layer, for the router and each expert's gate, up and down.
MIXTRAL_EXPERTS = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}.w1.weight",
                   "block_sparse_moe.experts.{expert}.w3.weight", "block_sparse_moe.experts.{expert}.w2.weight")
QWEN_MOE_EXPERTS = ("mlp.gate.weight", "mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight",
                    "mlp.experts.{expert}.down_proj.weight")
# DeepSeek's shared experts, as one of n_shared_experts x moe_intermediate_size (gate, up, down), without a gate.
DEEPSEEK_SHARED_EXPERT = ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                          "mlp.shared_experts.down_proj.weight")
# Qwen2-MoE's shared expert (gate, up, down) and its sigmoid gate (1, width).
QWEN_SHARED_EXPERT = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                      "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight")


def llama_tensors(cfg: ModelConfig, tied: bool, experts: tuple | None = None, shared: tuple | None = None) -> dict:
  """The rotary families' tensors; with `experts` (an architecture's names), the feed-forward layers' experts,
  and with `shared`, their shared expert (gate, up and down, and its sigmoid gate where it has one)."""
  return in_units(cfg, _llama_table(cfg, tied, experts, shared))


def _llama_table(cfg: ModelConfig, tied: bool, experts: tuple | None, shared: tuple | None) -> dict:
  """llama_tensors before in_units: each block weight as one block's."""
  d, f = cfg.embed_dim, cfg.mlp_dim
  layer = "model.layers.{layer}."
  table = _llama_dense_tensors(cfg, tied, layer)
  if experts is None:
    return table
  router, gate, up, down = (layer + name for name in experts)
  table = {path: tensor for path, tensor in table.items() if path[:2] != ("blocks", "mlp")}
  table.update({
      ("blocks", "mlp", "router"): Tensor(router, ((cfg.num_experts,), (d,)), (1, 0)),
      ("blocks", "mlp", "gate_kernel"): Tensor(gate, ((f,), (d,)), (1, 0), per_expert=True),
      ("blocks", "mlp", "up_kernel"): Tensor(up, ((f,), (d,)), (1, 0), per_expert=True),
      ("blocks", "mlp", "down_kernel"): Tensor(down, ((d,), (f,)), (1, 0), per_expert=True),
  })
  if shared is not None:
    fs, (gate, up, down, *shared_gate) = cfg.moe_shared_width, (layer + name for name in shared)
    table.update({
        ("blocks", "mlp", "shared", "gate_kernel"): Tensor(gate, ((fs,), (d,)), (1, 0)),
        ("blocks", "mlp", "shared", "up_kernel"): Tensor(up, ((fs,), (d,)), (1, 0)),
        ("blocks", "mlp", "shared", "down_kernel"): Tensor(down, ((d,), (fs,)), (1, 0)),
        **{("blocks", "mlp", "shared_gate_kernel"): Tensor(name, ((1,), (d,)), (1, 0)) for name in shared_gate},
    })
  return table


def in_units(cfg: ModelConfig, table: dict) -> dict:
  """`table` with each block weight at its place in the scanned unit (model/transformer.py Unit) where the
  blocks are grouped: every layer of a mixture of experts (a unit of one, or moe_every)."""
  if not (cfg.num_experts or cfg.layers_per_unit > 1):
    return table
  k = cfg.layers_per_unit
  return {**{path: tensor for path, tensor in table.items() if path[0] != "blocks"},
          **{("blocks", "layers", j, *path[1:]): dataclasses.replace(tensor, unit_layers=k, unit_layer=j)
             for path, tensor in table.items() if path[0] == "blocks" for j in range(k)}}


def gemma_tensors(cfg: ModelConfig, tied: bool) -> dict:
  """Llama's tensors with Gemma's four norms a layer (model/gemma.py), and Gemma 3's query/key norms."""
  layer = "model.layers.{layer}."
  table = {path: tensor for path, tensor in _llama_dense_tensors(cfg, tied, layer).items()
           if path not in (("blocks", "norm_attn", "scale"), ("blocks", "norm_mlp", "scale"))}
  norms = {"norm_attn": "input_layernorm", "post_norm_attn": "post_attention_layernorm",
           "norm_mlp": "pre_feedforward_layernorm", "post_norm_mlp": "post_feedforward_layernorm"}
  table.update({("blocks", ours, "scale"): _same(f"{layer}{theirs}.weight", cfg.embed_dim)
                for ours, theirs in norms.items()})
  return table


def deepseek_tensors(cfg: ModelConfig, tied: bool) -> dict:
  """Llama's tensors with DeepSeek's latent attention (model/mla.py), whose weights it lays out as these are, and
  its experts: Qwen-MoE's names, an ungated shared expert and the router's selection bias; the first dense layers
  (first_k_dense_replace, moe.first_dense) a stack of their own, the routed layers' numbers counted after them."""
  routed = _deepseek_table(cfg, tied)
  modules = _prediction_modules(cfg, routed) if cfg.mtp_depth else {}
  if not cfg.moe_first_dense:
    return {**routed, **modules}
  dense = _deepseek_table(dense_layers_config(cfg), tied)
  return {**{path: dataclasses.replace(tensor, first_layer=cfg.moe_first_dense) if path[0] == STACKED else tensor
             for path, tensor in routed.items()},
          **{(DENSE_STACKED, *path[1:]): tensor for path, tensor in dense.items() if path[0] == STACKED}, **modules}


def _prediction_modules(cfg: ModelConfig, routed: dict) -> dict:
  """The multi-token prediction modules (model/mtp.py) as DeepSeek-V3's checkpoint holds them, after the stack's
  layers (its layer 61): each a routed layer's tensors beside enorm, hnorm, eh_proj and shared_head.norm (the copies
  of the token table and the head it also stores are the model's own, not read). transformers' MtpModel reads the
  same names."""
  at = lambda tensor: dataclasses.replace(tensor, first_layer=cfg.num_layers, unit_layers=1, unit_layer=0)
  layer, d, moe_layer = "model.layers.{layer}.", cfg.embed_dim, cfg.layers_per_unit - 1
  table = {}
  for path, tensor in routed.items():
    if path[0] == STACKED and (path[1] != "layers" or path[2] == moe_layer):  # a unit's routed layer
      table[(MTP, "block", *(path[3:] if path[1] == "layers" else path[1:]))] = at(tensor)
  norms = {"token_norm": "enorm", "hidden_norm": "hnorm", "output_norm": "shared_head.norm"}
  table.update({(MTP, ours, "scale"): at(_same(f"{layer}{theirs}.weight", d)) for ours, theirs in norms.items()})
  # eh_proj reads [embedding; hidden state]: meshlm's merge kernel is (half, input, output).
  table[(MTP, "merge_kernel")] = at(Tensor(layer + "eh_proj.weight", ((d,), (2, d)), (1, 2, 0)))
  return table


def _deepseek_table(cfg: ModelConfig, tied: bool) -> dict:
  """deepseek_tensors of one stack: cfg's layers, routed where it has experts."""
  layer = "model.layers.{layer}."
  attn, c, r = layer + "self_attn.", cfg.mla_kv_rank, cfg.mla_rope_dim
  d, n, h, q, v = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mla_q_rank, cfg.mla_v_dim
  experts = QWEN_MOE_EXPERTS if cfg.num_experts else None
  table = {path: tensor for path, tensor in _llama_table(cfg, tied, experts, DEEPSEEK_SHARED_EXPERT if experts else None
                                                         ).items() if path[:2] != ("blocks", "attn")}
  if experts:
    table[("blocks", "mlp", "router_bias")] = _same(layer + "mlp.gate.e_score_correction_bias", cfg.num_experts)
  table.update({
      ("blocks", "attn", "q_kernel"): Tensor(attn + ("q_b_proj.weight" if q else "q_proj.weight"), ((n, h), (q or d,)),
                                             (2, 0, 1)),
      ("blocks", "attn", "kv_down_kernel"): Tensor(attn + "kv_a_proj_with_mqa.weight", ((c + r,), (d,)), (1, 0)),
      ("blocks", "attn", "kv_norm", "scale"): _same(attn + "kv_a_layernorm.weight", c),
      ("blocks", "attn", "kv_up_kernel"): Tensor(attn + "kv_b_proj.weight", ((n, h - r + v), (c,)), (2, 0, 1)),
      ("blocks", "attn", "out_kernel"): Tensor(attn + "o_proj.weight", ((d,), (n, v)), (1, 2, 0)),
      **({("blocks", "attn", "q_down_kernel"): Tensor(attn + "q_a_proj.weight", ((q,), (d,)), (1, 0)),
          ("blocks", "attn", "q_norm", "scale"): _same(attn + "q_a_layernorm.weight", q)} if q else {}),
  })
  return in_units(cfg, table)


def _llama_dense_tensors(cfg: ModelConfig, tied: bool, layer: str) -> dict:
  d, n, k, h, f, v = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                      cfg.vocab_size)
  return {
      ("embed",): Tensor("model.embed_tokens.weight", ((v,), (d,)), (0, 1), padded_axis=0),
      ("blocks", "norm_attn", "scale"): _same(layer + "input_layernorm.weight", d),
      ("blocks", "attn", "q_kernel"): Tensor(layer + "self_attn.q_proj.weight", ((n, h), (d,)), (2, 0, 1)),
      ("blocks", "attn", "k_kernel"): Tensor(layer + "self_attn.k_proj.weight", ((k, h), (d,)), (2, 0, 1)),
      ("blocks", "attn", "v_kernel"): Tensor(layer + "self_attn.v_proj.weight", ((k, h), (d,)), (2, 0, 1)),
      ("blocks", "attn", "out_kernel"): Tensor(layer + "self_attn.o_proj.weight", ((d,), (n, h)), (1, 2, 0)),
      ("blocks", "norm_mlp", "scale"): _same(layer + "post_attention_layernorm.weight", d),
      ("blocks", "mlp", "gate_kernel"): Tensor(layer + "mlp.gate_proj.weight", ((f,), (d,)), (1, 0)),
      ("blocks", "mlp", "up_kernel"): Tensor(layer + "mlp.up_proj.weight", ((f,), (d,)), (1, 0)),
      ("blocks", "mlp", "down_kernel"): Tensor(layer + "mlp.down_proj.weight", ((d,), (f,)), (1, 0)),
      ("norm_final", "scale"): _same("model.norm.weight", d),
      ("head",): Tensor("model.embed_tokens.weight" if tied else "lm_head.weight", ((v,), (d,)), (1, 0),
                        padded_axis=1),
      **_qwen_attention_tensors(cfg, layer + "self_attn."),
  }


def _qwen_attention_tensors(cfg: ModelConfig, attn: str) -> dict:
  """Qwen2's query/key/value biases (its o_proj has none), Qwen3's per-head query/key norms (model/qwen.py) and
  OLMoE's whole-width ones (model/olmoe.py, heads x head_dim gains stored flat)."""
  k, h = cfg.num_kv_heads, cfg.head_dim
  heads = {"q": cfg.num_heads, "k": k, "v": k}
  norm = {"head": lambda x: _same(f"{attn}{x}_norm.weight", h),
          "width": lambda x: Tensor(f"{attn}{x}_norm.weight", ((heads[x], h),), (0, 1))}.get(cfg.traits.qk_norm)
  return {**({("blocks", "attn", f"{x}_bias"): Tensor(f"{attn}{x}_proj.bias", ((heads[x], h),), (0, 1))
              for x in heads} if cfg.traits.qkv_bias else {}),
          **({("blocks", "attn", f"{x}_norm", "scale"): norm(x) for x in "qk"} if norm else {})}


def tensors(cfg: ModelConfig, tied: bool) -> dict:
  """meshlm weight path -> Tensor, for the family of `cfg`."""
  return mapping_of(cfg).tensors(cfg, tied)


def mapping_of(cfg: ModelConfig) -> "FamilyMapping":
  """The Hugging Face architecture of `cfg`'s family, with or without experts; refuses one transformers lacks."""
  if cfg.family in UNMAPPED:
    raise ValueError(f"meshlm's {cfg.family} has no Hugging Face architecture: {UNMAPPED[cfg.family]}.")
  gemma_like = {"model.attention_softcap": cfg.attention_softcap, "model.logit_softcap": cfg.logit_softcap,
                "model.global_every": cfg.global_every, "model.attention_scale_width": cfg.attention_scale_width,
                "model.local_rope_theta": cfg.local_rope_theta}
  if any(gemma_like.values()) and not any(m.capped for m in MAPPINGS.values() if m.family == cfg.family):
    set_here = ", ".join(f"{name}={value}" for name, value in gemma_like.items() if value)
    raise ValueError(f"{set_here}: meshlm's {cfg.family} exports to an architecture that computes none of these; "
                     "export a gemma2 or gemma3 model, or one trained without them.")
  if bool(cfg.mla_kv_rank) != (cfg.family == "deepseek3"):
    raise ValueError(f"mla.kv_rank={cfg.mla_kv_rank} with model.family={cfg.family!r}: latent attention exports as "
                     "DeepseekV3ForCausalLM, which has nothing else; export a deepseek3 model with mla.kv_rank > 0.")
  holding = [m for m in MAPPINGS.values() if m.holds(cfg)]
  found = next((m for m in holding if m.family == cfg.family), None)
  if found is None:  # the architectures that hold these settings, or where none does, every one
    choices = sorted(holding or MAPPINGS.values(), key=lambda m: list(FAMILIES).index(m.family))
    named = [f"{m.family} ({m.architecture}: {m.holding})" for m in choices]
    raise ValueError(
        f"meshlm's {cfg.family} with moe.experts={cfg.num_experts}, moe.shared_width={cfg.moe_shared_width} and "
        f"model.sliding_window={cfg.sliding_window} has no Hugging Face architecture"
        f"{'' if holding else ', nor does any family with those settings'}; export a "
        f"{', '.join(named[:-1])}{' or ' * (len(named) > 1)}{named[-1]} model.")
  if cfg.num_experts and cfg.moe_every != 1:
    raise ValueError(f"moe.every={cfg.moe_every}: {found.architecture} makes every feed-forward layer a mixture "
                     "of experts; export a model trained with moe.every=1.")
  if cfg.num_experts and not cfg.moe_renormalize and found.architecture == "MixtralForCausalLM":
    raise ValueError("moe.renormalize=False: Mixtral always renormalises its top-k router weights; export a "
                     "model trained with moe.renormalize=True.")
  return found


def model_fields(hf: dict, where: str) -> tuple[dict, bool]:
  """(`config.model` fields, tied embeddings) from a config.json, or a ValueError naming what meshlm cannot run."""
  architectures = hf.get("architectures") or []
  mapping = next((m for m in MAPPINGS.values() if m.architecture in architectures), None)
  if mapping is None:
    raise ValueError(f"{where} declares architectures {architectures}; meshlm imports "
                     f"{', '.join(m.architecture for m in MAPPINGS.values())} checkpoints.")
  _refuse(hf, where, mapping.refused)
  try:
    return mapping.fields(hf, where), mapping.tied(hf)
  except KeyError as missing:
    raise ValueError(f"{where} lacks the field {missing}, which a {mapping.architecture} config needs.") from None


# (field, its default in transformers, what meshlm computes instead when it differs)
_GPT2_REFUSED = (
    ("activation_function", "gelu_new", "only tanh-approximated GELU (gelu_new)"),
    ("scale_attn_weights", True, "attention scaled by 1/sqrt(head_dim)"),
    ("scale_attn_by_inverse_layer_idx", False, "no per-layer attention scaling"),
    ("add_cross_attention", False, "no cross-attention"),
    ("tie_word_embeddings", True, "a head tied to the token embedding"),
)
# The rotary families' refusals are also what their export writes (_llama_config).
_LLAMA_REFUSED = (
    ("hidden_act", "silu", "SwiGLU with silu"),
    ("attention_bias", False, "no attention biases"),
    ("mlp_bias", False, "no MLP biases"),
)
_NO_SLIDING_WINDOW = ("use_sliding_window", False, "attention over the whole causal context")
_DEEPSEEK_REFUSED = (*_LLAMA_REFUSED[:2], ("rope_interleave", True, "rotary dimensions in adjacent pairs"))
_GEMMA_REFUSED = (("hidden_activation", "gelu_pytorch_tanh", "GeGLU with tanh-GELU"), _LLAMA_REFUSED[1])
# Gemma's layer kinds (config.json's layer_types): local ones in its sliding window, and global ones.
LOCAL, GLOBAL = "sliding_attention", "full_attention"
_QWEN2_REFUSED = (_LLAMA_REFUSED[0], _NO_SLIDING_WINDOW)  # its biases are fixed: q/k/v have them, o_proj not
_QWEN3_REFUSED = (*_LLAMA_REFUSED[:2], _NO_SLIDING_WINDOW)
_OLMOE_REFUSED = (*_LLAMA_REFUSED[:2], ("clip_qkv", None, "queries, keys and values unclipped"))
_MISTRAL_REFUSED = (_LLAMA_REFUSED[0],)
_MIXTRAL_REFUSED = (_LLAMA_REFUSED[0], ("router_jitter_noise", 0.0, "a router without noise"))
# Where a layer's feed-forward is dense or experts: meshlm's import makes every layer experts.
_EVERY_LAYER_EXPERTS = (("decoder_sparse_step", 1, "every feed-forward layer a mixture of experts"),
                        ("mlp_only_layers", [], "every feed-forward layer a mixture of experts"))
# transformers' rotary types (rope_type) meshlm computes (model/rotary.py rotary_frequencies), and the
# fields of each it reads into config.model: {transformers' name: meshlm's}.
ROPE_FIELDS = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_len"},
    # beta_fast, beta_slow, attention_factor and truncate may be left out: meshlm's defaults are transformers'.
    "yarn": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_len",
             "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "attention_factor": "rope_attention_factor",
             "truncate": "rope_truncate"},
    # dynamic's pre-training context is the config's max_position_embeddings (_llama_fields reads it).
    "dynamic": {"factor": "rope_factor"},
}
# YaRN's other way to set its attention factor (DeepSeek's); meshlm takes attention_factor or derives it from factor.
_YARN_REFUSED = ("mscale", "mscale_all_dim")
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "attention_factor": 0.0}  # 0: derived


def _refuse(hf: dict, where: str, refused) -> None:
  for field, default, meshlm in refused:
    value = hf.get(field, default)
    if value != default and not (field == "activation_function" and value in TANH_GELU):
      raise ValueError(f"{where} sets {field}={value!r}, but meshlm computes {meshlm}.")


def _gpt2_fields(hf: dict, where: str) -> dict:
  del where  # every GPT-2 config.json meshlm reads is complete once _refuse has passed it
  width = hf["n_embd"]
  return dict(family="gpt2", num_layers=hf["n_layer"], num_heads=hf["n_head"], kv_heads=0,
              embed_dim=width, mlp_dim=hf.get("n_inner") or 4 * width, max_len=hf["n_positions"],
              vocab_size=hf["vocab_size"], norm_eps=hf.get("layer_norm_epsilon", FAMILIES["gpt2"].norm_eps))


def _llama_fields(hf: dict, where: str, family: str = "llama", windowed: bool = False) -> dict:
  """config.model for the rotary families: their config.json fields are the same. A
  `windowed` architecture's sliding_window is read too (Qwen's config.json names one it does not use)."""
  width, heads = hf["hidden_size"], hf["num_attention_heads"]
  head_width = hf.get("head_dim") or width // heads
  # transformers 5 keeps rotary settings in rope_parameters; earlier versions in rope_scaling and rope_theta.
  rope = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ROPE_FIELDS:
    raise ValueError(f"{where} sets rope_type={rope_type!r}, but meshlm computes rotary positions "
                     f"{', '.join(ROPE_FIELDS)} only.")
  if rope_type == "yarn" and (unread := [f for f in _YARN_REFUSED if rope.get(f)]):
    raise ValueError(f"{where} sets yarn's {unread[0]}={rope[unread[0]]!r}, but meshlm computes YaRN's attention factor "
                     "from attention_factor or factor only.")
  scaling = {ours: type(getattr(ModelConfig, ours))(rope[theirs])
             for theirs, ours in ROPE_FIELDS[rope_type].items() if rope.get(theirs) is not None}
  if rope_type == "dynamic":
    scaling["rope_original_max_len"] = hf["max_position_embeddings"]
  return dict(**scaling, rope_type=rope_type, family=family, num_layers=hf["num_hidden_layers"], num_heads=heads,
              sliding_window=(hf.get("sliding_window") or 0) if windowed else 0,  # null or absent: none
              head_width=0 if head_width * heads == width else head_width,
              kv_heads=hf.get("num_key_value_heads") or heads, embed_dim=width,
              mlp_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
              norm_eps=hf.get("rms_norm_eps", FAMILIES[family].norm_eps), rope_theta=float(rope["rope_theta"]))


# transformers 5 writes num_local_experts for every MoE architecture; Qwen-MoE configs before it, num_experts.
EXPERT_COUNT = ("num_local_experts", "num_experts")


def _expert_fields(hf: dict, where: str, family: str, width: str, renormalize: bool, windowed: bool = False) -> dict:
  """config.model and config.moe (dotted) fields of a mixture-of-experts checkpoint: its family's fields, the
  experts' count, width and top k, every choice kept, and whether the top-k weights are renormalised (the
  config's norm_topk_prob, else the architecture's `renormalize`), and Qwen2-MoE's shared expert's width."""
  experts = next((hf[name] for name in EXPERT_COUNT if name in hf), None)
  if experts is None:
    raise KeyError(" or ".join(EXPERT_COUNT))
  return {**_llama_fields(hf, where, family, windowed), "mlp_dim": hf[width], "moe.experts": experts,
          "moe.top_k": hf["num_experts_per_tok"], "moe.every": 1, "moe.dropless": True,
          "moe.renormalize": bool(hf.get("norm_topk_prob", renormalize)),
          "moe.shared_width": hf.get("shared_expert_intermediate_size") or 0}


def _gemma_fields(hf: dict, where: str, family: str) -> dict:
  """config.model for Gemma 2 and 3: the rotary fields (Gemma 3's local layers' base apart), the scale and caps, and
  the layers' windows, where every k-th layer must be the global one (config.json's layer_types; without it, every
  other layer for Gemma 2, every sliding_window_pattern-th, 6, for Gemma 3)."""
  layers = hf["num_hidden_layers"]
  pattern = hf.get("sliding_window_pattern") or {"gemma2": 2, "gemma3": 6}[family]  # before layer_types
  kinds = hf.get("layer_types") or _layer_kinds(layers, pattern, windowed=True)
  every = next((k for k in range(1, layers + 1) if kinds == _layer_kinds(layers, k, windowed=True)), 0)
  if not every and set(kinds) != {LOCAL}:
    raise ValueError(f"{where} sets layer_types {kinds}; meshlm computes every k-th layer global and the others "
                     "local (model.global_every), or every layer local.")
  # transformers 5 writes Gemma 3's rotary settings per layer kind; earlier ones the local base apart.
  by_kind = hf.get("rope_parameters") if GLOBAL in (hf.get("rope_parameters") or {}) else None
  local = by_kind.get(LOCAL, {}) if by_kind else {"rope_theta": hf.get("rope_local_base_freq")}
  if local.get("rope_type", "default") != "default":
    raise ValueError(f"{where} rescales its local layers' rotary positions ({local['rope_type']}); meshlm rotates "
                     "them by their own base only (model.local_rope_theta).")
  fields = _llama_fields({**hf, "rope_parameters": by_kind[GLOBAL]} if by_kind else hf, where, family)
  local_theta = float(local.get("rope_theta") or fields["rope_theta"])
  if not every:  # every layer local: the local base is the only one
    fields = {**fields, "rope_theta": local_theta, "rope_type": "default"}
  window = hf.get("sliding_window") or 0
  return {**fields, "sliding_window": 0 if every == 1 else window, "global_every": every if every > 1 else 0,
          "local_rope_theta": local_theta if every > 1 and local_theta != fields["rope_theta"] else 0.0,
          "attention_softcap": float(hf.get("attn_logit_softcapping") or 0.0),
          "logit_softcap": float(hf.get("final_logit_softcapping") or 0.0),
          "attention_scale_width": int(hf["query_pre_attn_scalar"])}


def _layer_kinds(layers: int, every: int, windowed: bool) -> list[str]:
  """config.json's layer_types: every `every`-th layer global, the others local; every layer local where
  `every` is 0 and there is a window, global where there is none."""
  if not every:
    return [LOCAL if windowed else GLOBAL] * layers
  return [LOCAL if (i + 1) % every else GLOBAL for i in range(layers)]


def _deepseek_fields(hf: dict, where: str) -> dict:
  """config.model, config.mla and config.moe (dotted) fields of DeepSeek-V3 (and V2-Lite's shape in its
  architecture): Llama's, with the latent attention's ranks and widths (a query/key head is qk_nope_head_dim +
  qk_rope_head_dim wide) and, where its layers route, DeepSeek's routing over every layer."""
  layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 3)
  routed = bool(hf.get("n_routed_experts")) and dense < layers
  nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
  rotary = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}
  mscale, mscale_all_dim = (rotary.get(name) for name in _YARN_REFUSED)
  plain = {key: value for key, value in rotary.items() if key not in _YARN_REFUSED}
  fields = {**_llama_fields({**hf, "rope_parameters": plain}, where, "deepseek3"), "head_width": nope + rope,
            "kv_heads": 0, "mla.kv_rank": hf["kv_lora_rank"], "mla.q_rank": hf.get("q_lora_rank") or 0,
            "mla.rope_dim": rope, "mla.v_dim": hf["v_head_dim"]}
  if fields["rope_type"] == "yarn" and (mscale or mscale_all_dim):  # DeepSeek's own YaRN attention factors
    factor = fields["rope_factor"]
    if not fields.get("rope_attention_factor"):
      fields["rope_attention_factor"] = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                                         if mscale and mscale_all_dim else _yarn_mscale(factor))
    if mscale_all_dim:
      fields["mla.score_scale"] = _yarn_mscale(factor, mscale_all_dim) ** 2
  if not routed:
    return fields
  # Prediction modules: config.json counts them (transformers' default 1, even where it saved none, which
  # hf_checkpoint.open_checkpoint reads as none); they are routed layers.
  fields["mtp_depth"] = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
  width = hf["moe_intermediate_size"]
  return {**fields, "mlp_dim": width, "moe.experts": hf["n_routed_experts"], "moe.top_k": hf["num_experts_per_tok"],
          "moe.every": 1, "moe.dropless": True, "moe.renormalize": bool(hf.get("norm_topk_prob", True)),
          "moe.shared_width": width * hf.get("n_shared_experts", 1), "moe.shared_gate": False,
          "moe.score": "sigmoid", "moe.groups": hf.get("n_group") or 1, "moe.group_top_k": hf.get("topk_group") or 1,
          "moe.scale": float(hf.get("routed_scaling_factor", 1.0)), "moe.router_bias": True,
          "moe.first_dense": dense, "moe.dense_width": hf["intermediate_size"] if dense else 0}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention factor for a context `factor` times longer, as DeepSeek parametrises it."""
  return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _deepseek_config(cfg: ModelConfig, tied: bool, dtype: str) -> dict:
  rope = cfg.mla_rope_dim
  written = {**_llama_config(cfg, tied, dtype), "head_dim": rope, "num_key_value_heads": cfg.num_heads,
             "q_lora_rank": cfg.mla_q_rank or None, "kv_lora_rank": cfg.mla_kv_rank, "qk_rope_head_dim": rope,
             "qk_nope_head_dim": cfg.head_dim - rope, "v_head_dim": cfg.mla_v_dim,
             "first_k_dense_replace": cfg.num_layers, "num_mtp_layers": cfg.mtp_depth}
  if cfg.mla_score_scale != 1.0:  # as mscale_all_dim, beside the rotary's own attention factor written out
    if cfg.rope_type != "yarn" or cfg.rope_factor <= 1:
      raise ValueError(f"mla.score_scale={cfg.mla_score_scale}: DeepseekV3ForCausalLM scales its scores only through "
                       "YaRN's mscale_all_dim; export a model with model.rope_type=yarn and rope_factor > 1, or with "
                       "score_scale 1.")
    # Both mscales from the two factors they set (rounded to 12 digits, past float arithmetic's noise), so an
    # imported DeepSeek config is written back as it was read.
    log_factor = 0.1 * math.log(cfg.rope_factor)
    mscale_all_dim = round((cfg.mla_score_scale ** 0.5 - 1.0) / log_factor, 12)
    attention_factor = cfg.rope_attention_factor or _yarn_mscale(cfg.rope_factor)
    mscale = round((attention_factor * _yarn_mscale(cfg.rope_factor, mscale_all_dim) - 1.0) / log_factor, 12)
    rotary = {**{k: v for k, v in written["rope_parameters"].items() if k != "attention_factor"},
              "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    written = {**written, "rope_parameters": rotary,
               "rope_scaling": {k: v for k, v in rotary.items() if k != "rope_theta"}}
  if not cfg.num_experts:
    if cfg.mtp_depth:
      raise ValueError(f"model.mtp_depth={cfg.mtp_depth} without experts: DeepseekV3ForCausalLM's prediction modules "
                       "are routed layers; export a model with moe.experts > 0, or one trained with mtp_depth=0.")
    return written
  routing = {"moe.score": (cfg.moe_score, "sigmoid"), "moe.shared_gate": (cfg.moe_shared_gate, False),
             "moe.router_bias": (cfg.moe_router_bias, True)}
  if unlike := [f"{name}={ours} (DeepSeek-V3: {theirs})" for name, (ours, theirs) in routing.items() if ours != theirs]:
    raise ValueError(f"{', '.join(unlike)}: DeepseekV3ForCausalLM routes by sigmoid scores with a selection bias, "
                     "beside ungated shared experts; export a model trained so.")
  if not cfg.moe_shared_width or cfg.moe_shared_width % cfg.mlp_dim:
    raise ValueError(f"moe.shared_width={cfg.moe_shared_width}: DeepseekV3ForCausalLM's shared experts are "
                     f"n_shared_experts >= 1 experts of the routed ones' width, model.mlp_dim={cfg.mlp_dim}; export a "
                     "model whose shared width is a multiple of it.")
  return {**written, "first_k_dense_replace": cfg.moe_first_dense, "n_routed_experts": cfg.num_experts,
          "intermediate_size": cfg.moe_dense_width or cfg.mlp_dim,
          "num_experts_per_tok": cfg.moe_top_k, "moe_intermediate_size": cfg.mlp_dim,
          "n_shared_experts": cfg.moe_shared_width // cfg.mlp_dim, "n_group": cfg.moe_groups,
          "topk_group": cfg.moe_group_top_k, "routed_scaling_factor": cfg.moe_scale,
          "norm_topk_prob": cfg.moe_renormalize}


def hf_config(cfg: ModelConfig, tied: bool, dtype: str = "float32") -> dict:
  """A config.json that transformers builds the same model from, with `dtype` weights."""
  if cfg.activation and cfg.activation != cfg.traits.activation:
    raise ValueError(f"model.activation={cfg.activation!r}: the config.json meshlm writes for {cfg.family} names "
                     f"its own {cfg.traits.activation}; export a model trained with model.activation empty.")
  if cfg.unet_skips or cfg.value_embeds or cfg.qk_norm:
    raise ValueError(f"model.unet_skips={cfg.unet_skips}, model.value_embeds={cfg.value_embeds} and model.qk_norm="
                     f"{cfg.qk_norm}: no transformers architecture for {cfg.family} has U-net skips, value embeddings "
                     "or query and key norms; export a model trained without them.")
  return mapping_of(cfg).config(cfg, tied, dtype)


def _gpt2_config(cfg: ModelConfig, tied: bool, dtype: str) -> dict:
  del tied  # always tied
  if cfg.head_dim * cfg.num_heads != cfg.embed_dim:
    raise ValueError(f"model.head_width={cfg.head_width} x {cfg.num_heads} heads is not the width "
                     f"{cfg.embed_dim}, which transformers' GPT-2 requires; export a model with head_width 0.")
  return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_layer=cfg.num_layers,
                n_head=cfg.num_heads, n_embd=cfg.embed_dim, n_inner=cfg.mlp_dim, n_positions=cfg.position_rows,
                vocab_size=cfg.vocab_size, layer_norm_epsilon=cfg.epsilon, activation_function="gelu_new",
                # meshlm trains without dropout; unwritten, transformers would fill in GPT-2's 0.1.
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                tie_word_embeddings=True, dtype=dtype)


def _llama_config(cfg: ModelConfig, tied: bool, dtype: str) -> dict:
  mapping = mapping_of(cfg)
  rope = {"rope_type": cfg.rope_type,
          **{theirs: getattr(cfg, ours) for theirs, ours in ROPE_FIELDS[cfg.rope_type].items()}}
  if cfg.rope_type == "yarn":  # only what differs from transformers' defaults, which are meshlm's
    rope = {k: v for k, v in rope.items() if _YARN_DEFAULTS.get(k, object()) != v}
  return dict(architectures=[mapping.architecture], model_type=mapping.model_type, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              hidden_size=cfg.embed_dim, head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim,
              vocab_size=cfg.vocab_size, rms_norm_eps=cfg.epsilon,
              max_position_embeddings=cfg.rope_original_max_len if cfg.rope_type == "dynamic" else cfg.max_len,
              attention_dropout=0.0, **{field: default for field, default, _ in mapping.refused},
              rope_theta=cfg.rope_theta, rope_scaling=None if cfg.rope_type == "default" else rope,  # transformers 4
              rope_parameters={"rope_theta": cfg.rope_theta, **rope},  # transformers 5
              **({"sliding_window": cfg.sliding_window or None} if mapping.windowed else {}),
              tie_word_embeddings=tied, dtype=dtype)


def _gemma_config(cfg: ModelConfig, tied: bool, dtype: str) -> dict:
  written = {**_llama_config(cfg, tied, dtype), "sliding_window": cfg.sliding_window or cfg.max_len,
             "layer_types": _layer_kinds(cfg.num_layers, cfg.global_every, bool(cfg.sliding_window)),
             "query_pre_attn_scalar": cfg.attention_scale_width or cfg.head_dim,
             "attn_logit_softcapping": cfg.attention_softcap or None,
             "final_logit_softcapping": cfg.logit_softcap or None}
  if cfg.family != "gemma3":
    return written
  # Gemma 3's rotary settings per layer kind (transformers 5), and its local base (transformers 4).
  local_theta = cfg.local_rope_theta or cfg.rope_theta
  return {**written, "rope_local_base_freq": local_theta,
          "rope_parameters": {GLOBAL: written["rope_parameters"], LOCAL: {"rope_type": "default",
                                                                          "rope_theta": local_theta}}}


def _expert_config(cfg: ModelConfig, tied: bool, dtype: str, width: str, **fixed) -> dict:
  """_llama_config with the experts' count (under each name transformers has read it by), width and top k."""
  return {**_llama_config(cfg, tied, dtype), **dict.fromkeys(EXPERT_COUNT, cfg.num_experts), width: cfg.mlp_dim,
          "num_experts_per_tok": cfg.moe_top_k, **fixed}


# Registered families (model/families.py) that no Hugging Face architecture holds: family -> why, which export
# gives as its refusal (tests/test_families.py holds every other family to a mapping).
UNMAPPED: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class FamilyMapping:
  """One Hugging Face architecture's conversion: adding a family (or its experts) adds one of these."""

  architecture: str  # config.json's `architectures` entry
  model_type: str  # config.json's `model_type`
  family: str  # meshlm's model.family, registered in model/families.py (tests/test_families.py holds the two alike)
  experts: bool | None  # whether its feed-forward layers are mixtures of experts (moe.experts > 0); None: either
  shared: bool  # whether its experts have a shared one beside them (moe.shared_width > 0)
  windowed: bool  # whether its attention may slide a window (config.json's sliding_window: model.sliding_window)
  refused: tuple  # (field, transformers' default, what meshlm computes instead)
  fields: Callable[[dict, str], dict]  # config.json -> config.model fields (config.moe's as "moe.NAME")
  tied: Callable[[dict], bool]  # whether config.json ties the head to the token table
  tensors: Callable[[ModelConfig, bool], dict]  # meshlm weight path -> Tensor
  config: Callable[[ModelConfig, bool, str], dict]  # config.model -> config.json
  capped: bool = False  # it soft-caps, alternates local and global layers and scales scores its own way (Gemma 2)

  def holds(self, cfg: ModelConfig) -> bool:
    """Whether the architecture holds cfg's experts, shared expert and window, whatever cfg's family."""
    return (self.experts in (None, bool(cfg.num_experts))
            and (not cfg.num_experts or self.shared == bool(cfg.moe_shared_width))
            and (self.windowed or not cfg.sliding_window))

  @property
  def holding(self) -> str:
    """What it holds, in words: experts (and a shared one) or dense, and a window."""
    if self.experts is None:
      return "dense, or experts and a shared expert" + ", a window" * self.windowed
    kind = ("experts and a shared expert" if self.shared else "experts") if self.experts else "dense"
    return kind + ", a window" * self.windowed


def _rotary(architecture: str, model_type: str, family: str, refused: tuple, experts: tuple | None = None,
            fields=None, config=None, windowed: bool = False, shared: tuple | None = None) -> FamilyMapping:
  return FamilyMapping(architecture, model_type, family, experts is not None, shared is not None, windowed, refused,
                       fields or functools.partial(_llama_fields, family=family, windowed=windowed),
                       lambda hf: bool(hf.get("tie_word_embeddings", False)),
                       functools.partial(llama_tensors, experts=experts, shared=shared), config or _llama_config)


MAPPINGS = {mapping.architecture: mapping for mapping in (
    FamilyMapping("GPT2LMHeadModel", "gpt2", "gpt2", False, False, False, _GPT2_REFUSED, _gpt2_fields, lambda hf: True,
                  gpt2_tensors, _gpt2_config),
    _rotary("LlamaForCausalLM", "llama", "llama", _LLAMA_REFUSED),
    _rotary("Qwen2ForCausalLM", "qwen2", "qwen2", _QWEN2_REFUSED),
    _rotary("Qwen3ForCausalLM", "qwen3", "qwen3", _QWEN3_REFUSED),
    _rotary("MistralForCausalLM", "mistral", "llama", _MISTRAL_REFUSED, windowed=True),
    _rotary("MixtralForCausalLM", "mixtral", "llama", _MIXTRAL_REFUSED, MIXTRAL_EXPERTS,
            functools.partial(_expert_fields, family="llama", width="intermediate_size", renormalize=True,
                              windowed=True),
            functools.partial(_expert_config, width="intermediate_size"), windowed=True),
    _rotary("Qwen2MoeForCausalLM", "qwen2_moe", "qwen2", _QWEN2_REFUSED + _EVERY_LAYER_EXPERTS, QWEN_MOE_EXPERTS,
            # transformers' default norm_topk_prob is False, as the released Qwen1.5-MoE and Qwen2-MoE set it.
            functools.partial(_expert_fields, family="qwen2", width="moe_intermediate_size", renormalize=False),
            lambda cfg, tied, dtype: _expert_config(cfg, tied, dtype, width="moe_intermediate_size",
                                                    intermediate_size=cfg.mlp_dim, norm_topk_prob=cfg.moe_renormalize,
                                                    shared_expert_intermediate_size=cfg.moe_shared_width),
            shared=QWEN_SHARED_EXPERT),
    _rotary("OlmoeForCausalLM", "olmoe", "olmoe", _OLMOE_REFUSED, QWEN_MOE_EXPERTS,
            functools.partial(_expert_fields, family="olmoe", width="intermediate_size", renormalize=False),
            lambda cfg, tied, dtype: _expert_config(cfg, tied, dtype, width="intermediate_size",
                                                    norm_topk_prob=cfg.moe_renormalize)),
    *(dataclasses.replace(_rotary(architecture, model_type, family, _GEMMA_REFUSED, config=_gemma_config,
                                  fields=functools.partial(_gemma_fields, family=family), windowed=True),
                          tied=lambda hf: bool(hf.get("tie_word_embeddings", True)), tensors=gemma_tensors, capped=True)
      for architecture, model_type, family in (("Gemma2ForCausalLM", "gemma2", "gemma2"),
                                               ("Gemma3ForCausalLM", "gemma3_text", "gemma3"))),
    dataclasses.replace(_rotary("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek3", _DEEPSEEK_REFUSED,
                                fields=_deepseek_fields, config=_deepseek_config),
                        experts=None, shared=True, tensors=deepseek_tensors),
    _rotary("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3", _QWEN3_REFUSED + _EVERY_LAYER_EXPERTS, QWEN_MOE_EXPERTS,
            # transformers' default norm_topk_prob is False; the released Qwen3-MoE checkpoints set it True.
            functools.partial(_expert_fields, family="qwen3", width="moe_intermediate_size", renormalize=False),
            lambda cfg, tied, dtype: _expert_config(cfg, tied, dtype, width="moe_intermediate_size",
                                                    intermediate_size=cfg.mlp_dim, norm_topk_prob=cfg.moe_renormalize)),
)}
