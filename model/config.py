"""The frozen model description: everything the model needs, nothing about the run."""

import dataclasses
import math

import jax.numpy as jnp

from model.families import FAMILIES, Family

REMAT_POLICIES = ("none", "full", "full_offload", "save_dots", "save_attention", "offload")  # model/transformer.py
ATTENTION_KERNELS = ("auto", "xla", "cudnn", "splash")  # model/attention.py kernel
ACTIVATION_NAMES = ("gelu", "silu", "relu2")  # model/layers.py ACTIVATIONS, each by its name
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")  # model/rotary.py rotary_frequencies
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float8")
VOCAB_MULTIPLE = 128  # pad the vocabulary so the embedding shards evenly and matmuls tile well


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str  # a name in model/families.py FAMILIES
  num_layers: int
  num_heads: int
  embed_dim: int
  mlp_dim: int
  max_len: int
  vocab_size: int
  positions: int = 0  # learned position rows (gpt2), at least max_len; 0: max_len (position_rows)
  remat: str = "none"  # none | full | full_offload | save_dots | save_attention | offload
  scan_layers: bool = True  # one scanned block (fast compiles) or the layers unrolled (model/transformer.py)
  recompute_activation: bool = False  # GELU / SiLU recomputed from their inputs in the backward pass
  activation: str = ""  # the feed-forward activation; "": the family's own (GPT-2 tanh-GELU, Llama SiLU)
  zero_init_out: bool = False  # the attention's output and the MLP's down projections start at zero
  # U-net skips (model/unet.py): unit j of the stack's second half adds, times a learned weight, the output of unit
  # H-1-j of its first half (modded-nanogpt); needs an even number of units
  unet_skips: bool = False
  # k > 0: k token tables of value width (model/value_embeds.py); the first k layers and the last k mix table i's
  # rows into their values, each by two learned weights (modded-nanogpt: 3); 0: off
  value_embeds: int = 0
  # queries and keys RMS-normalised per head, one gain per head width shared by the heads, before rotary (gpt2 and
  # Llama-style attention; Qwen3's and Gemma 3's have their own as a family trait)
  qk_norm: bool = False
  attention: str = "auto"  # auto | xla | cudnn | splash (model/attention.py kernel)
  attention_block: int = 512  # positions per query and key block of the xla attention (model/attention.py)
  sliding_window: int = 0  # W > 0: each query sees only the W latest positions up to its own (Mistral); 0: all
  attention_softcap: float = 0.0  # C > 0: each attention score s enters the softmax as C tanh(s / C) (Gemma 2: 50)
  # k > 0: every k-th layer attends over the whole causal context, the others within sliding_window (Gemma 2: 2,
  # Gemma 3: 6); k need not divide num_layers (Gemma 3 1B's 26 layers end with two local ones)
  global_every: int = 0
  # with global_every: the local layers' rotary base, without rope_type's rescaling (Gemma 3: 10000, its global
  # layers 1e6 and linear x8); 0: every layer rotates alike
  local_rope_theta: float = 0.0
  # scores scaled by 1 / sqrt(this) rather than the head width (Gemma 2's query_pre_attn_scalar); 0: the head width
  attention_scale_width: int = 0
  logit_softcap: float = 0.0  # C > 0: each output logit z as C tanh(z / C) (Gemma 2: 30); 0: off
  fp8_head: bool = False  # the head's matmul in fp8 at fixed scales (model/fp8.py fixed_scale_einsum; modded-nanogpt)
  # D > 0: D multi-token prediction modules after the stack, the k-th predicting token i+k+1 (model/mtp.py;
  # DeepSeek-V3: 1), their mean cross-entropy added to the objective at mtp_weight (DeepSeek-V3: 0.3, then 0.1)
  mtp_depth: int = 0
  mtp_weight: float = 0.3
  loss_chunk: int = 4096  # positions per chunk of the head and loss; plan() converts the config's tokens per device
  mlp_chunk: int = 0  # positions per chunk of a dense feed-forward layer, 0 the whole sequence; as loss_chunk
  # plan() sets it under hybrid sharding: look tokens up in the table with its `embed` axis gathered
  gathered_lookup: bool = False
  document_end: int = -1  # the token ending each packed document (attention stops there); -1: no packing
  compute_dtype: str = "float32"
  kv_heads: int = 0  # llama's grouped-query attention; 0 means as many as num_heads
  head_width: int = 0  # each attention head's width; 0 means embed_dim // num_heads (Qwen3 sets its own)
  rope_theta: float = 10000.0
  # multi-head latent attention (model/mla.py, DeepSeek-V2/V3) where mla_kv_rank > 0: keys and values from a latent
  # this wide, a rotary key of mla_rope_dim shared by the heads (head_width = no-position part + mla_rope_dim),
  # values mla_v_dim wide, queries through a latent of mla_q_rank (0: projected directly)
  mla_kv_rank: int = 0
  mla_q_rank: int = 0
  mla_rope_dim: int = 0
  mla_v_dim: int = 0
  mla_score_scale: float = 1.0  # scores times this beyond 1/sqrt(head_width) (DeepSeek's YaRN mscale_all_dim)
  # llama: rotary frequencies rescaled for a longer context (model/rotary.py rotary_frequencies):
  rope_type: str = "default"  # default | linear | llama3 | yarn | dynamic
  rope_factor: float = 1.0  # linear, llama3, yarn, dynamic: how many times longer the context than in pre-training
  rope_low_freq_factor: float = 1.0  # llama3: wavelengths over original_max_len / this are divided
  rope_high_freq_factor: float = 4.0  # llama3: wavelengths under original_max_len / this are kept
  rope_original_max_len: int = 0  # llama3, yarn, dynamic: the pre-training context
  rope_beta_fast: float = 32.0  # yarn: rotations over the pre-training context above which a pair is kept
  rope_beta_slow: float = 1.0  # yarn: and below which it is divided by rope_factor
  rope_attention_factor: float = 0.0  # yarn: cos and sin scaled by it; 0: 0.1 ln(rope_factor) + 1
  rope_truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole pairs
  norm_eps: float = 0.0  # LayerNorm / RMSNorm epsilon; 0 means the family's own (Family.norm_eps)
  num_experts: int = 0  # 0: dense; E > 0: every moe_every-th feed-forward layer is a mixture of E experts
  moe_every: int = 1
  # the first k layers dense, before the routed ones (DeepSeek-V3: 3), their MLP moe_dense_width wide (0: mlp_dim);
  # a second scanned stack of their own (model/transformer.py DENSE_STACKED)
  moe_first_dense: int = 0
  moe_dense_width: int = 0
  moe_top_k: int = 2
  moe_capacity_factor: float = 1.25
  moe_dropless: bool = False
  moe_shared_width: int = 0  # F_s > 0: a shared SwiGLU expert of that width, sigmoid-gated (Qwen2-MoE)
  moe_renormalize: bool = True  # the k chosen experts' weights scaled to sum to one (Mixtral); False: softmax's own
  moe_balance_weight: float = 0.01
  # DeepSeek-V3's routing (model/moe.py route): experts scored by a sigmoid each rather than one softmax; chosen
  # within the moe_group_top_k best of moe_groups equal groups; the routed output times moe_scale; a shared
  # expert added without a gate; a per-expert bias added to the scores for the choice only, moved each step by
  # moe_bias_rate against its expert's load error (auxiliary-loss-free balancing; training/step.py)
  moe_score: str = "softmax"
  moe_groups: int = 1
  moe_group_top_k: int = 1
  moe_scale: float = 1.0
  moe_shared_gate: bool = True
  moe_router_bias: bool = False
  moe_bias_rate: float = 0.0
  moe_z_weight: float = 0.001
  mup_base_width: int = 0  # muP's base width (model/mup.py); 0: the standard parametrisation

  @property
  def head_qk_norm(self) -> bool:
    """Whether each query and key head is normalised before rotary: model.qk_norm, or the family's "head" trait."""
    return self.qk_norm or self.traits.qk_norm == "head"

  @property
  def position_rows(self) -> int:
    """Rows of a learned position table: model.positions, or max_len."""
    return self.positions or self.max_len

  @property
  def layers_per_unit(self) -> int:
    """Layers in each scanned unit (model/transformer.py Unit): one dense block, or moe_every blocks whose last
    is MoE."""
    return self.moe_every if self.num_experts else 1

  @property
  def global_layers(self) -> tuple[bool, ...]:
    """Whether each layer attends over the whole causal context (model.global_every); all True without windows
    alternating. Layer i is global when i + 1 is a multiple of global_every, as transformers' layer_types."""
    return tuple(not self.global_every or (i + 1) % self.global_every == 0 for i in range(self.num_layers))

  @property
  def num_units(self) -> int:
    """Units of the scanned stack: the layers after the first moe_first_dense, in units of layers_per_unit."""
    return (self.num_layers - self.moe_first_dense) // self.layers_per_unit

  @property
  def moe_layers(self) -> int:
    return self.num_units if self.num_experts else 0

  @property
  def head_dim(self) -> int:
    return self.head_width or self.embed_dim // self.num_heads

  @property
  def num_kv_heads(self) -> int:
    return self.kv_heads or self.num_heads

  @property
  def traits(self) -> Family:
    return FAMILIES[self.family]

  @property
  def mlp_activation(self) -> str:
    """The feed-forward activation, a name in model/layers.py ACTIVATIONS."""
    return self.activation or self.traits.activation

  @property
  def epsilon(self) -> float:
    return self.norm_eps or self.traits.norm_eps

  @property
  def padded_vocab(self) -> int:
    return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

  @property
  def idle_expert_params(self) -> int:
    """Parameters of the E - k experts a token skips: they cost memory but no FLOPs (MFU leaves them out)."""
    d, f = self.embed_dim, self.mlp_dim
    per_expert = (3 if self.traits.gated_mlp else 2) * d * f + (f + d if self.traits.biases else 0)
    return (self.num_experts - self.moe_top_k) * per_expert * self.moe_layers

  @property
  def dtype(self):
    """The activations' dtype; float8 runs its weight matmuls in fp8 between bfloat16 activations."""
    return jnp.dtype("bfloat16" if self.fp8 else self.compute_dtype)

  @property
  def width_multiplier(self) -> float:
    """muP's m: the width over the base width (1 without muP)."""
    return self.embed_dim / self.mup_base_width if self.mup_base_width else 1.0

  @property
  def output_multiplier(self) -> float:
    """What the logits are multiplied by: muP's 1 / m (1 without muP)."""
    return 1 / self.width_multiplier

  @property
  def fp8(self) -> bool:
    return self.compute_dtype == "float8"

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"model.family={self.family!r} is unknown; use one of {', '.join(FAMILIES)}.")
    if self.head_width < 0:
      raise ValueError(f"model.head_width={self.head_width} must be at least 0 (0: model.embed_dim // "
                       "model.num_heads).")
    if not self.head_width and self.embed_dim % self.num_heads:
      raise ValueError(
          f"model.embed_dim={self.embed_dim} is not divisible by model.num_heads={self.num_heads}; "
          "choose heads that divide the width, or set model.head_width.")
    if self.kv_heads < 0:
      raise ValueError(f"model.kv_heads={self.kv_heads} must be at least 0 (0: as many as model.num_heads).")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} is not a multiple of model.kv_heads={self.num_kv_heads}; "
          "grouped-query attention shares each key/value head among an equal number of query heads.")
    if self.activation and self.activation not in ACTIVATION_NAMES:
      raise ValueError(f"model.activation={self.activation!r} is unknown; use one of {', '.join(ACTIVATION_NAMES)}, "
                       "or leave it empty for the family's own.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r} is unknown; use one of {', '.join(REMAT_POLICIES)}.")
    if self.attention not in ATTENTION_KERNELS:
      raise ValueError(f"model.attention={self.attention!r} is unknown; use one of {', '.join(ATTENTION_KERNELS)}.")
    for field in ("attention_block", "loss_chunk"):
      if getattr(self, field) < 1:
        raise ValueError(f"model.{field}={getattr(self, field)} must be a positive number of positions.")
    if self.positions and self.positions < self.max_len:
      raise ValueError(f"model.positions={self.positions} must be at least model.max_len={self.max_len}, the "
                       "training length, or 0 for as many.")
    if self.sliding_window < 0:
      raise ValueError(f"model.sliding_window={self.sliding_window} must be a number of positions, or 0 for "
                       "attention over the whole causal context.")
    for field in ("attention_softcap", "logit_softcap"):
      if not (math.isfinite(getattr(self, field)) and getattr(self, field) >= 0):
        raise ValueError(f"model.{field}={getattr(self, field)} must be a finite cap > 0 (Gemma 2 caps attention "
                         "scores at 50 and logits at 30), or 0 for none.")
    if self.attention_softcap and self.attention == "cudnn":
      raise ValueError(f"model.attention=cudnn cannot soft-cap attention scores (model.attention_softcap="
                       f"{self.attention_softcap}): JAX's cuDNN attention takes no cap; use model.attention=auto or xla.")
    if self.mtp_depth:
      self._check_mtp()
    if self.fp8_head and self.compute_dtype == "float16":
      raise ValueError("model.fp8_head=True with precision.compute=float16: float16's loss scale (2^15 and more) "
                       "multiplies the logits' gradient past the fp8 head's fixed scale; use bfloat16 or float32.")
    if self.unet_skips and self.num_units % 2:
      raise ValueError(f"model.unet_skips pairs the first half of the stack's units with the second, but it has "
                       f"{self.num_units} units; use an even model.num_layers (or units of moe.every layers).")
    if self.value_embeds:
      self._check_value_embeds()
    if self.qk_norm and (self.traits.qk_norm or self.traits.model == "gemma.Gemma" or self.mla_kv_rank):
      raise ValueError(f"model.qk_norm adds query and key norms to gpt2 and Llama-style attention, not to "
                       f"{self.family}{' with mla.kv_rank' if self.mla_kv_rank else ''}, whose attention "
                       f"{'normalises them its own way' if self.traits.qk_norm else 'is its own'}; leave it off.")
    if self.mlp_chunk < 0:
      raise ValueError(f"model.mlp_chunk={self.mlp_chunk} must be a number of tokens, or 0 for the whole sequence.")
    if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
      raise ValueError(f"model.rope_theta={self.rope_theta} must be a finite number > 0 (the rotary base; "
                       "10000 is usual).")
    self._check_rope()
    if not (math.isfinite(self.norm_eps) and self.norm_eps >= 0):
      raise ValueError(f"model.norm_eps={self.norm_eps} must be a finite number >= 0 (0: the family's own, "
                       + ", ".join(f"{traits.norm_eps:g} for {family}" for family, traits in FAMILIES.items()) + ").")
    if not -1 <= self.document_end < self.vocab_size:
      raise ValueError(f"model.document_end={self.document_end} is not a token of the vocabulary of "
                       f"model.vocab_size={self.vocab_size}; use the tokenizer's end-of-text id, or -1 for no "
                       "packed documents.")
    if self.num_experts:
      self._check_moe()
    elif self.moe_first_dense or self.moe_dense_width:
      raise ValueError(f"moe.first_dense={self.moe_first_dense} and moe.dense_width={self.moe_dense_width} set the "
                       "dense layers before the routed ones, but moe.experts=0 routes none; set moe.experts, or "
                       "leave them at 0.")
    if self.global_every:
      self._check_global_every()
    elif self.local_rope_theta:
      raise ValueError(f"model.local_rope_theta={self.local_rope_theta} is the local layers' rotary base, but "
                       "model.global_every=0 makes no layer global; set global_every (Gemma 3: 6) or leave it at 0.")
    if self.attention_scale_width < 0:
      raise ValueError(f"model.attention_scale_width={self.attention_scale_width} must be at least 0 (0: scores "
                       "scaled by the head width, as usual).")
    if self.mup_base_width:
      self._check_mup()
    if self.mla_kv_rank or self.mla_q_rank or self.mla_rope_dim or self.mla_v_dim or self.mla_score_scale != 1.0:
      self._check_mla()
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(
          f"precision.compute={self.compute_dtype!r} is unknown; use one of {', '.join(COMPUTE_DTYPES)}.")

  def _check_mtp(self):
    if not 0 < self.mtp_depth < self.max_len:
      raise ValueError(f"model.mtp_depth={self.mtp_depth} must be a number of prediction modules from 1 to "
                       f"model.max_len - 1 = {self.max_len - 1} (DeepSeek-V3: 1), or 0 for none.")
    if not (math.isfinite(self.mtp_weight) and self.mtp_weight > 0):
      raise ValueError(f"model.mtp_weight={self.mtp_weight} must be a finite weight > 0 on the prediction modules' "
                       "loss (DeepSeek-V3: 0.3, later 0.1); set model.mtp_depth=0 for no modules.")

  def _check_value_embeds(self):
    if not 0 < self.value_embeds <= self.num_layers // 2:
      raise ValueError(f"model.value_embeds={self.value_embeds} must be a number of tables from 1 to half of "
                       f"model.num_layers={self.num_layers} (the first and the last layers use one each; "
                       "modded-nanogpt: 3 of 12), or 0 for none.")
    if self.layers_per_unit > 1 or self.moe_first_dense or self.mla_kv_rank:
      raise ValueError(f"model.value_embeds={self.value_embeds} is built for a stack of single blocks whose "
                       "attention projects values: not for moe.every > 1, moe.first_dense or mla.kv_rank; turn one "
                       "of them off.")

  def _check_global_every(self):
    if self.global_every < 1:
      raise ValueError(f"model.global_every={self.global_every} must be at least 1: every k-th layer is global "
                       "(Gemma 2: 2, Gemma 3: 6), or 0 for every layer alike.")
    if not self.sliding_window:
      raise ValueError(f"model.global_every={self.global_every} makes the other layers attend within "
                       "model.sliding_window, which is 0; set the local layers' window (Gemma 2: 4096).")
    if self.local_rope_theta < 0 or (self.local_rope_theta and not self.traits.rotary):
      raise ValueError(f"model.local_rope_theta={self.local_rope_theta} must be a positive rotary base for a family "
                       "with rotary positions, or 0 for every layer rotating alike.")
    if self.num_experts:
      raise ValueError(f"model.global_every={self.global_every} and moe.experts={self.num_experts}: layers that "
                       "alternate windows and experts are not built; use one or the other.")

  def _check_deepseek_routing(self):
    if self.moe_score not in ("softmax", "sigmoid"):
      raise ValueError(f"moe.score={self.moe_score!r} is unknown; use softmax (one distribution over the experts) "
                       "or sigmoid (each expert scored apart, DeepSeek-V3).")
    per_group = self.num_experts // max(self.moe_groups, 1)
    if (self.moe_groups < 1 or self.num_experts % self.moe_groups or not 1 <= self.moe_group_top_k <= self.moe_groups
        or self.moe_top_k > self.moe_group_top_k * per_group or (self.moe_groups > 1 and per_group < 2)):
      raise ValueError(f"moe.groups={self.moe_groups} and moe.group_top_k={self.moe_group_top_k} must split "
                       f"moe.experts={self.num_experts} into equal groups of at least 2 and keep at least moe.top_k="
                       f"{self.moe_top_k} experts in the chosen groups (DeepSeek-V3: 8 groups of 32, 4 chosen, 8 "
                       "experts); 1 and 1 choose over every expert.")
    if not (math.isfinite(self.moe_scale) and self.moe_scale > 0):
      raise ValueError(f"moe.scale={self.moe_scale} must be a finite number > 0 (DeepSeek-V3: 2.5; 1: unscaled).")
    if not (math.isfinite(self.moe_bias_rate) and self.moe_bias_rate >= 0) or (self.moe_bias_rate and
                                                                               not self.moe_router_bias):
      raise ValueError(f"moe.bias_rate={self.moe_bias_rate} must be a finite number >= 0, and above 0 only with "
                       "moe.router_bias=True, the bias it moves (DeepSeek-V3: 0.001).")

  def _check_rope(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"model.rope_type={self.rope_type!r} is unknown; use one of {', '.join(ROPE_TYPES)}.")
    if self.rope_type == "default":
      return
    if not self.traits.rotary:
      raise ValueError(f"model.rope_type={self.rope_type!r} rescales rotary positions, which the {self.family} "
                       "family does not use; leave it 'default'.")
    if not (math.isfinite(self.rope_factor) and self.rope_factor > 0):
      raise ValueError(f"model.rope_factor={self.rope_factor} must be a finite number > 0 (8 in Llama 3.1).")
    if self.rope_type == "llama3" and not (
        self.rope_original_max_len > 0 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
      raise ValueError(
          f"model.rope_type='llama3' needs rope_original_max_len > 0 and 0 < rope_low_freq_factor < "
          f"rope_high_freq_factor; they are {self.rope_original_max_len}, {self.rope_low_freq_factor} and "
          f"{self.rope_high_freq_factor} (Llama 3.1: 8192, 1 and 4).")
    if self.rope_type == "yarn" and not (self.rope_original_max_len > 0 and self.rope_beta_slow < self.rope_beta_fast
                                         and self.rope_attention_factor >= 0):
      raise ValueError(
          f"model.rope_type='yarn' needs rope_original_max_len > 0, rope_beta_slow < rope_beta_fast and "
          f"rope_attention_factor >= 0; they are {self.rope_original_max_len}, {self.rope_beta_slow}, "
          f"{self.rope_beta_fast} and {self.rope_attention_factor} (YaRN's betas: 1 and 32).")
    if self.rope_type == "dynamic" and self.rope_original_max_len <= 0:
      raise ValueError(f"model.rope_type='dynamic' needs rope_original_max_len > 0, the context past which the "
                       f"rotary base grows; it is {self.rope_original_max_len}.")

  def _check_mla(self):
    rope, v, h = self.mla_rope_dim, self.mla_v_dim, self.head_dim
    if not (self.mla_kv_rank > 0 and self.mla_q_rank >= 0 and 0 < rope < h and rope % 2 == 0 and 0 < v <= h):
      raise ValueError(f"mla.kv_rank={self.mla_kv_rank}, mla.q_rank={self.mla_q_rank}, mla.rope_dim={rope} and "
                       f"mla.v_dim={v} do not describe latent attention with heads {h} wide: kv_rank > 0, q_rank >= 0, "
                       "an even rope_dim below the head width and 0 < v_dim <= head width (DeepSeek-V3: 512, 1536, 64 "
                       "and 128 with heads 192 wide).")
    if not (math.isfinite(self.mla_score_scale) and self.mla_score_scale > 0):
      raise ValueError(f"mla.score_scale={self.mla_score_scale} must be a finite number > 0 (1: scores over "
                       "sqrt(head width) only; DeepSeek-V3's YaRN: (0.1 ln 40 + 1)^2 = 1.87).")
    traits = self.traits
    if not traits.rotary or traits.qkv_bias or traits.qk_norm:
      raise ValueError(f"mla.kv_rank={self.mla_kv_rank} with model.family={self.family!r}: latent attention replaces "
                       "an attention of rotary positions without biases or query/key norms; use llama, gemma2 or "
                       "deepseek3.")
    if self.sliding_window or self.attention_scale_width or self.kv_heads not in (0, self.num_heads):
      raise ValueError(f"mla.kv_rank={self.mla_kv_rank} with model.sliding_window={self.sliding_window}, "
                       f"model.attention_scale_width={self.attention_scale_width} or model.kv_heads={self.kv_heads}: "
                       "latent attention has a key and value head per query head, over the whole causal context, "
                       "scaled by the head width; leave them at 0.")

  def _check_mup(self):
    base, width = self.mup_base_width, self.embed_dim
    if base < 0 or width % base or (self.num_heads * base) % width:
      raise ValueError(f"mup.base_width={base} must divide model.embed_dim={width} into a base model of whole heads "
                       f"as wide as these (model.num_heads={self.num_heads}), e.g. {width // self.num_heads}; or "
                       "leave it at 0 for the standard parametrisation.")
    if self.num_experts:
      raise ValueError(f"mup.base_width={base} with moe.experts={self.num_experts}: muP for the router and experts "
                       "is not built; train the dense model, or leave mup.base_width at 0.")

  def _check_moe(self):
    if self.num_experts < 0:
      raise ValueError(f"moe.experts={self.num_experts} is negative; use 0 for a dense model or E > 0 experts.")
    if not 1 <= self.moe_top_k <= self.num_experts:
      raise ValueError(f"moe.top_k={self.moe_top_k} must be between 1 and moe.experts={self.num_experts}; "
                       "each token picks k distinct experts.")
    if not self.moe_dropless and self.moe_capacity_factor <= 0:
      raise ValueError(f"moe.capacity_factor={self.moe_capacity_factor} must be positive (1.0 is each "
                       "expert's fair share, 1.25 is usual); set moe.dropless=True to drop nothing.")
    if self.moe_dropless and self.fp8:
      raise ValueError("moe.dropless=True with precision.compute=float8: the dropless experts run as grouped "
                       "matmuls (ragged_dot), which have no fp8 path; use a capacity factor or bfloat16.")
    for field in ("moe_balance_weight", "moe_z_weight"):
      if not (math.isfinite(getattr(self, field)) and getattr(self, field) >= 0):
        raise ValueError(f"moe.{field[4:]}={getattr(self, field)} must be a finite number >= 0 (0 turns that "
                         "loss off); a negative weight rewards what the loss penalises.")
    if self.moe_shared_width < 0 or (self.moe_shared_width and not self.traits.gated_mlp):
      gated = ", ".join(name for name, family in FAMILIES.items() if family.gated_mlp)
      raise ValueError(f"moe.shared_width={self.moe_shared_width}: a shared expert is a gated feed-forward layer of "
                       f"that width (Qwen2-MoE's SwiGLU), which model.family={self.family!r} does not have; use 0, "
                       f"or one of {gated}.")
    self._check_deepseek_routing()
    if not 0 <= self.moe_first_dense < self.num_layers or self.moe_dense_width < 0:
      raise ValueError(f"moe.first_dense={self.moe_first_dense} and moe.dense_width={self.moe_dense_width}: the "
                       f"dense layers before the routed ones must leave at least one of model.num_layers="
                       f"{self.num_layers} routed, and their width be >= 0 (DeepSeek-V3: 3 and 18432; 0: mlp_dim).")
    if self.moe_every < 1 or (self.num_layers - self.moe_first_dense) % self.moe_every:
      raise ValueError(f"moe.every={self.moe_every} does not divide model.num_layers={self.num_layers}; "
                       "every k-th layer is MoE, so choose a k that divides the layer count.")
