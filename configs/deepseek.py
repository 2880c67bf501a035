"""DeepSeek-V3's architecture in small (model/mla.py, model/moe.py). Launch:
python train.py --config=configs/deepseek.py:deepseek3_tiny

Llama's model with multi-head latent attention (queries through a latent, keys and values from another, a rotary
key shared by the heads, values narrower than the keys) and every feed-forward layer routed as DeepSeek-V3
routes: sigmoid scores, a token's top k within its best groups of experts, the weights renormalised and scaled,
one shared expert beside them, and balance kept by a per-expert selection bias moved each step against its
expert's load (moe.bias_rate) rather than by an auxiliary loss. `deepseek3_tiny` trains on the built-in byte
corpus on a CPU. The published DeepSeek-V3 and V2-Lite keep their first layers dense (first_k_dense_replace),
which meshlm's scanned stack of alike layers does not build yet, so their shapes are not here; a checkpoint
whose layers are all dense or all routed imports (`--config.init_from=hf:<directory>`).
"""

from configs.llama import get_config as llama_config


def get_config(variant: str = "deepseek3_tiny"):
  if variant != "deepseek3_tiny":
    raise ValueError(f"unknown DeepSeek variant {variant!r}; choose deepseek3_tiny.")
  c = llama_config("tiny")
  c.model.family = "deepseek3"
  c.model.num_layers, c.model.num_heads, c.model.kv_heads, c.model.embed_dim, c.model.max_len = 4, 4, 0, 128, 128
  # heads 32 wide, 8 of them rotary; a key/value latent of 32, a query latent of 48, values 24 wide
  c.model.head_width, c.mla.kv_rank, c.mla.q_rank, c.mla.rope_dim, c.mla.v_dim = 32, 32, 48, 8, 24
  # 16 experts 64 wide in 4 groups: a token's top 2 within its best 2 groups, weights x 2.5, one shared expert
  c.model.mlp_dim, c.moe.experts, c.moe.top_k, c.moe.every, c.moe.dropless = 64, 16, 2, 1, True
  c.moe.score, c.moe.groups, c.moe.group_top_k, c.moe.scale = "sigmoid", 4, 2, 2.5
  c.moe.shared_width, c.moe.shared_gate, c.moe.router_bias, c.moe.bias_rate = 64, False, True, 0.001
  c.moe.balance_weight = 0.0  # balanced by the bias alone
  return c
