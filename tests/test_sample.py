"""Generation with the KV cache equals recomputing the whole prefix, for both families, on a sharded mesh."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import ROOT, fresh_state, tiny_config
from measure import analysis
from model.kv_cache import init_cache
from parallel.mesh import EXPERT
from training.checkpoint import Checkpoints
from training.sample import decode_batch, generate, make_sampler
from training.state import plan

PROMPT = np.array([100, 101, 102, 32, 40, 41, 58], np.int32)  # "def ():"
FAMILIES = {"gpt2": {}, "llama": {"model.family": "llama", "model.kv_heads": 2},
            # 19 tokens through a window of 4: a rolling cache of 4 slots, the 7-token prompt overflowing it.
            "llama window": {"model.family": "llama", "model.kv_heads": 2, "model.sliding_window": 4},
            # Scores soft-capped tight enough to bite at initialisation, through the rolling cache (the logits'
            # cap is loose: one tight enough to bite ties the top logits, and greedy and top-1 pick apart).
            "llama window, soft-capped": {"model.family": "llama", "model.kv_heads": 2, "model.sliding_window": 4,
                                          "model.attention_softcap": 0.02, "model.logit_softcap": 1.0},
            "llama soft-capped": {"model.family": "llama", "model.kv_heads": 2, "model.attention_softcap": 0.02},
            # Gemma 2: local layers masking their cache by the window of 4, in turn with global ones.
            "gemma2": {"model.family": "gemma2", "model.kv_heads": 2, "model.sliding_window": 4,
                       "model.global_every": 2, "model.attention_softcap": 0.02, "model.attention_scale_width": 8},
            # Gemma 3's pattern in small: only the second of 3 layers global, its query/key norms and two rotary bases.
            "gemma3": {"model.family": "gemma3", "model.kv_heads": 2, "model.sliding_window": 4, "model.num_layers": 3,
                       "model.global_every": 2, "model.local_rope_theta": 100.0},
            # Latent attention: the cache holds each token's latent and rotary key, expanded at every step.
            "latent attention": {"model.family": "llama", "model.head_width": 24, "mla.kv_rank": 16, "mla.q_rank": 12,
                                 "mla.rope_dim": 8, "mla.v_dim": 16},
            "latent attention tensor=2": {"model.family": "llama", "model.head_width": 24, "mla.kv_rank": 16,
                                          "mla.rope_dim": 8, "mla.v_dim": 16, "mesh.tensor": 2},
            # DeepSeek-V3 in small: latent attention, a first dense layer with its own cache, sigmoid routing.
            "deepseek": {"model.family": "llama", "model.num_layers": 3, "model.head_width": 24, "mla.kv_rank": 16,
                         "mla.rope_dim": 8, "mla.v_dim": 16, "moe.experts": 4, "moe.dropless": True,
                         "moe.first_dense": 1, "moe.score": "sigmoid", "moe.router_bias": True},
            # Dropless routing is per token, so decoding one token at a time routes as the full pass does;
            # every=2 caches both layers of each scanned unit.
            "gpt2 moe": {"moe.experts": 4, "moe.dropless": True, "moe.every": 2},
            # The speedrun's U-net skips, value embeddings and QK-norm: the cached pass runs the stack in two halves,
            # mixes the new tokens' value rows into the first and last layers, and caches normalised keys.
            "llama unet, value embeddings, qk norm": {"model.family": "llama", "model.kv_heads": 2,
                                                      "model.num_layers": 4, "model.unet_skips": True,
                                                      "model.value_embeds": 1, "model.qk_norm": True},
            # The experts split over `expert`, each token sent to them by all-to-all (the slots with C = T).
            "gpt2 moe expert=2": {"moe.experts": 4, "moe.dropless": True, "mesh.expert": 2, "mesh.tensor": 1}}


def full_forward_logits(layout, params, tokens_T):
  """Every position's next-token logits from one uncached forward on one device."""

  @jax.jit
  def forward(params, tokens_1T):
    model = nnx.merge(layout.graphdef, params)
    return model.predict(tokens_1T)

  return np.asarray(forward(jax.device_get(params), tokens_T[None])[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_decoding_equals_full_recompute(family):
  config = tiny_config(**{"mesh.data": 2, "mesh.tensor": 2, **FAMILIES[family]})
  layout = plan(config, jax.devices()[:4])
  params = fresh_state(layout, config.seed)["params"]
  batch = decode_batch(layout, 1)
  sampler = make_sampler(layout, batch=batch, prompt_len=len(PROMPT), num_tokens=12, keep_logits=True)
  prompt_BP, key = np.tile(PROMPT, (batch, 1)), jax.random.key(0)
  tokens, logits = jax.device_get(sampler(params, prompt_BP, key, np.float32(0), np.int32(0), np.float32(1)))
  # Causal attention: the full forward's logits at each position are what a
  # recomputing decoder would see after feeding every earlier token.
  reference = full_forward_logits(layout, params, np.concatenate([PROMPT, tokens[0]]))[len(PROMPT) - 1:-1]
  np.testing.assert_allclose(logits[0], reference, rtol=1e-5, atol=1e-5)
  # A window's cache is a rolling buffer of its W slots, not max_len; Gemma 2's global layers need every position.
  m = layout.model
  assert init_cache(m, 1)["k"].shape[3] == (m.max_len if m.global_every else m.sliding_window or m.max_len)
  np.testing.assert_array_equal(tokens[0], reference.argmax(-1))
  # Sampling among the top 1 at any temperature is greedy; among the top 5 it is not.
  top_1, _ = jax.device_get(sampler(params, prompt_BP, key, np.float32(1.5), np.int32(1), np.float32(1)))
  np.testing.assert_array_equal(top_1, tokens)
  # A nucleus too small to hold two tokens keeps the most likely one: greedy again.
  nucleus, _ = jax.device_get(sampler(params, prompt_BP, key, np.float32(1.5), np.int32(0), np.float32(1e-6)))
  np.testing.assert_array_equal(nucleus, tokens)
  top_5, logits_5 = jax.device_get(sampler(params, prompt_BP, key, np.float32(1.5), np.int32(5), np.float32(1)))
  assert (top_5 != tokens).any()
  ranks = (logits_5[0] > np.take_along_axis(logits_5[0], top_5[0][:, None], axis=-1)).sum(-1)
  assert ranks.max() < 5  # but every pick is among the 5 most likely


def test_expert_parallel_decoding_exchanges_tokens_without_regathering_them(capfd):
  moe = {"moe.experts": 8, "moe.top_k": 2}  # moe_tiny's routing, with capacity, on README's expert=4 x data=2
  config = tiny_config(**moe, **{"mesh.expert": 4, "mesh.data": 2})
  layout = plan(config)
  batch = decode_batch(layout, 1)
  params = fresh_state(layout, config.seed)["params"]
  sampler = make_sampler(layout, batch=batch, prompt_len=len(PROMPT), num_tokens=6, keep_logits=True)
  prompt_BP, key = np.tile(PROMPT, (batch, 1)), jax.random.key(0)
  capfd.readouterr()
  compiled, partitioned = analysis.compile_partitioned(sampler.lower(params, prompt_BP, key, np.float32(0),
                                                                     np.int32(0), np.float32(1)))
  # XLA logs a reshard it can only do by replicating the tensor from C++, straight to file descriptor 2.
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  found = analysis.collectives(compiled, layout.mesh, partitioned=partitioned)
  # Dispatch and combine: one all-to-all each over `expert`, in the prefill's layer loop and in the decode
  # step's; neither the tokens nor the experts' weights are gathered in any loop.
  assert analysis.count_by(found, kind="all-to-all", axes=EXPERT, in_loop=True) == 4, analysis.summary_table(found)
  assert analysis.count_by(found, kind="all-gather", in_loop=True) == 0, analysis.summary_table(found)
  # The same tokens and logits as on one device.
  one_device = plan(tiny_config(**moe, **{"mesh.data": 1}), jax.devices()[:1])
  alone = make_sampler(one_device, batch=1, prompt_len=len(PROMPT), num_tokens=6, keep_logits=True)
  tokens_BN, logits_BNV = jax.device_get(compiled(params, prompt_BP, key, np.float32(0), np.int32(0), np.float32(1)))
  expected_1N, expected_1NV = alone(jax.device_get(params), PROMPT[None], key, np.float32(0), np.int32(0), np.float32(1))
  np.testing.assert_array_equal(tokens_BN[:1], expected_1N)
  np.testing.assert_allclose(logits_BNV[:1], expected_1NV, rtol=1e-5, atol=1e-5)


def test_requests_the_cache_cannot_hold_are_refused():
  layout = plan(tiny_config(**{"mesh.data": 1}), jax.devices()[:1])
  with pytest.raises(ValueError, match="exceeds the model's context of model.max_len=32"):
    generate(layout, None, PROMPT, num_tokens=26)
  with pytest.raises(ValueError, match="top_k=300 is outside 0..256"):
    generate(layout, None, PROMPT, num_tokens=4, top_k=300)
  with pytest.raises(ValueError, match="num_samples=0 must be at least 1"):
    generate(layout, None, PROMPT, num_tokens=4, num_samples=0)


def test_sample_cli_continues_a_checkpoint_on_another_mesh(tmp_path):
  config = tiny_config(**{"mesh.data": 8, "workdir": str(tmp_path)})
  checkpoints = Checkpoints(str(tmp_path), every=1, keep=1)
  checkpoints.save_now(1, fresh_state(plan(config), config.seed), config)
  checkpoints.close()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  result = subprocess.run([sys.executable, "sample.py", f"--workdir={tmp_path}", "--prompt=import",
                           "--max_tokens=10", "--mesh=data=2,tensor=2", "--num_samples=3", "--top_k=8"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  samples = result.stdout.split("--- sample ")[1:]
  assert len(samples) == 3 and all(s.split("\n", 1)[1].startswith("import") for s in samples), result.stdout
