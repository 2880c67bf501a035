"""DeepSeek-V3's architecture (model/mla.py, model/moe.py). Launch:
python train.py --config=configs/deepseek.py:deepseek3_tiny

Llama's model with multi-head latent attention (queries through a latent, keys and values from another, a rotary
key shared by the heads, values narrower than the keys), its first layers dense (a stack of their own,
moe.first_dense) and the rest routed as DeepSeek-V3 routes: sigmoid scores, a token's top k within its best
groups of experts, the weights renormalised and scaled, one shared expert beside them, and balance kept by a
per-expert selection bias moved each step against its expert's load (moe.bias_rate) rather than by an auxiliary
loss. `deepseek3_tiny` trains on the built-in byte corpus on a CPU; `deepseek3_671b` is DeepSeek-V3's published
shape at its pre-training context of 4,096 with its one multi-token prediction module (its config.json adds YaRN
for 128K, which an import reads), for planning or to hold an imported checkpoint (`--config.init_from=hf:<directory>`
sets the shape from its config.json).
"""

from configs.llama import get_config as llama_config

# name: (layers, dense first, heads, width, dense MLP width, context, vocabulary)
SIZES = {
    "deepseek3_tiny": (4, 1, 4, 128, 256, 128, 256),
    "deepseek3_671b": (61, 3, 128, 7168, 18432, 4096, 129280),
}
# name: (head width, rotary part, values, key/value latent, query latent)
ATTENTION = {"deepseek3_tiny": (32, 8, 24, 32, 48), "deepseek3_671b": (192, 64, 128, 512, 1536)}
# name: (experts, top k, groups, groups chosen, expert width)
EXPERTS = {"deepseek3_tiny": (16, 2, 4, 2, 64), "deepseek3_671b": (256, 8, 8, 4, 2048)}


def get_config(variant: str = "deepseek3_tiny"):
  if variant not in SIZES:
    raise ValueError(f"unknown DeepSeek variant {variant!r}; choose one of {', '.join(SIZES)}.")
  c = llama_config("tiny" if variant.endswith("_tiny") else "1b")
  layers, dense, heads, width, dense_width, context, vocab = SIZES[variant]
  c.model.family, c.model.num_layers, c.model.num_heads, c.model.kv_heads = "deepseek3", layers, heads, 0
  c.model.embed_dim, c.model.max_len, c.model.vocab_size = width, context, vocab
  c.model.head_width, c.mla.rope_dim, c.mla.v_dim, c.mla.kv_rank, c.mla.q_rank = ATTENTION[variant]
  experts, top_k, groups, chosen, expert_width = EXPERTS[variant]
  c.moe.experts, c.moe.top_k, c.moe.every, c.moe.dropless = experts, top_k, 1, True
  c.moe.first_dense, c.moe.dense_width, c.model.mlp_dim = dense, dense_width, expert_width
  c.moe.score, c.moe.groups, c.moe.group_top_k, c.moe.scale = "sigmoid", groups, chosen, 2.5
  c.moe.shared_width, c.moe.shared_gate, c.moe.router_bias, c.moe.bias_rate = expert_width, False, True, 0.001
  c.moe.balance_weight = 0.0  # balanced by the bias (DeepSeek-V3 adds a sequence-wise loss of weight 1e-4)
  c.model.rope_theta = 10000.0
  # DeepSeek-V3 trained one multi-token prediction module at weight 0.3 (0.1 for its last 4.8T tokens); the tiny
  # one trains without unless asked (--config.model.mtp_depth=1), as the `mtp` recipe compares.
  c.model.mtp_depth = 0 if variant.endswith("_tiny") else 1
  return c
