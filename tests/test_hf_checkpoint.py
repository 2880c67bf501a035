"""Hugging Face checkpoints in and out, checked against transformers itself.

Small random GPT-2 and Llama models are built and saved by transformers in a
sidecar Python 3.11 environment (.venv-hf, tests/hf_reference.py), which also
computes the reference logits and loss; the tests import them into meshlm and
compare. Tolerance: float32 on both sides, differing only in the order of
reductions, so logits agree to 1e-5 of the largest |logit| (about 1e-6 is
measured) and the first training loss to 1e-5 relative. Export is exact:
transformers loads the exported directory to the very bits it saved.
"""

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from configs.gpt2 import get_config
from configs.load import set_fields
from helpers import (ROOT, assert_tree_close, batch_at, gradients, prediction_logits, read_metrics, run_reference,
                     tiny_config)
from input_pipeline import data
from interop import hf_checkpoint, hf_mapping
from interop.export import export
from model.placement import placed
from parallel import placement
from run.loop import train
from training.checkpoint import Checkpoints
from training.state import model_config, plan, state_from_params


VOCAB = 300  # padded to 384 inside meshlm
LLAMA_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False)
DEEPSEEK_ROUTED = dict(LLAMA_SHAPE, num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1,
                       q_lora_rank=12, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=20,
                       n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=24,
                       n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
# name: (family, transformers config, save_pretrained arguments)
MODELS = {
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, n_inner=128), {}),
    "llama": ("llama", dict(LLAMA_SHAPE, rms_norm_eps=1e-5, rope_theta=500.0), {}),
    "llama_tied": ("llama", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
                   {"max_shard_size": "100KB"}),  # several files and model.safetensors.index.json
    # Llama 3.1's rotary scaling and position interpolation, with a pre-training context of 8 positions
    # so that the 16 tokens reach past it and llama3's three bands of frequencies all occur.
    "llama3": ("llama", dict(LLAMA_SHAPE, rope_theta=500.0, max_position_embeddings=64, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}), {}),
    "llama_linear": ("llama", dict(LLAMA_SHAPE, rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
                     {}),
    # YaRN (as Qwen2.5's long-context and DeepSeek's checkpoints set it) from a pre-training context of 8 positions:
    # the ramp between kept and divided pairs falls inside the 8 pairs of a 16-wide head.
    "llama_yarn": ("llama", dict(LLAMA_SHAPE, rope_theta=500.0, max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 8.0}), {}),
    # Qwen2.5's small models tie their head; Qwen3's heads are wider than hidden_size / heads (24, not 16).
    "qwen2": ("qwen2", dict(LLAMA_SHAPE, rope_theta=1e6, tie_word_embeddings=True), {}),
    "qwen3": ("qwen3", dict(LLAMA_SHAPE, rope_theta=1e6, head_dim=24), {}),
    # Mistral's sliding window of 4 positions, over 16 tokens.
    "mistral": ("mistral", dict(LLAMA_SHAPE, sliding_window=4), {}),
    # Mixtral renormalises its top-2 router weights; this Qwen3-MoE keeps the softmax's (norm_topk_prob False).
    "mixtral": ("mixtral", dict(LLAMA_SHAPE, num_local_experts=4, num_experts_per_tok=2), {}),
    "qwen3_moe": ("qwen3_moe", dict(LLAMA_SHAPE, head_dim=24, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=48, norm_topk_prob=False), {}),
    # Qwen2-MoE: q/k/v biases, and a shared expert (width 80) behind a sigmoid gate beside 4 routed ones.
    "qwen2_moe": ("qwen2_moe", dict(LLAMA_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=80), {}),
    # OLMoE: query and key norms over the whole width, the softmax's top-2 weights kept.
    "olmoe": ("olmoe", dict(LLAMA_SHAPE, num_experts=4, num_experts_per_tok=2), {}),
    # Gemma 2: local layers in a window of 4 alternating with global ones, scores scaled by 1/sqrt(16) rather
    # than the head width 24, both caps low enough to bite, sandwich norms, GeGLU, the embedding scaled.
    "gemma2": ("gemma2", dict(LLAMA_SHAPE, num_hidden_layers=4, head_dim=24, sliding_window=4,
                              query_pre_attn_scalar=16, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                              tie_word_embeddings=True), {}),
    # Gemma 3: every third of 5 layers global (it does not divide them), query and key norms, the local layers'
    # rotary base 100 beside the global ones' 10,000 rescaled linearly x2, no caps.
    "gemma3": ("gemma3", dict(LLAMA_SHAPE, num_hidden_layers=5, head_dim=24, sliding_window=4, query_pre_attn_scalar=16,
                              layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2,
                              tie_word_embeddings=True,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 10000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
               {}),
    # DeepSeek-V3's latent attention with every layer dense: queries through a rank-12 latent, keys and values from a
    # rank-16 one, 8 rotary dimensions in adjacent pairs beside 16 without, values 20 wide, and DeepSeek's YaRN
    # from a context of 8 (its mscale and mscale_all_dim set apart: cos and sin, and every score, scaled); and
    # V2-Lite's queries projected directly.
    "deepseek3": ("deepseek_v3", dict(LLAMA_SHAPE, num_key_value_heads=4, first_k_dense_replace=2, num_mtp_layers=0,
                                      q_lora_rank=12, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                      v_head_dim=20, max_position_embeddings=64, rope_parameters={
                                          "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                                          "original_max_position_embeddings": 8, "mscale": 1.0,
                                          "mscale_all_dim": 0.8}), {}),
    # DeepSeek-V3's layout: a first dense layer (its MLP 96 wide), then routed ones: sigmoid scores, 8 experts in 4
    # groups of which a token's best 2 hold its top 2, weights renormalised and scaled by 2.5, one ungated shared
    # expert, and a selection bias (random here).
    "deepseek3_moe": ("deepseek_v3", dict(DEEPSEEK_ROUTED, num_mtp_layers=0), {}),
    # Two multi-token prediction modules after deepseek3_moe's layers, each a routed layer (layers 3 and 4 of the file).
    "deepseek3_mtp": ("deepseek_v3", dict(DEEPSEEK_ROUTED, num_mtp_layers=2), {}),
    "deepseek3_direct_queries": ("deepseek_v3", dict(LLAMA_SHAPE, num_key_value_heads=4, first_k_dense_replace=2,
                                                     num_mtp_layers=0, q_lora_rank=None, kv_lora_rank=16,
                                                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8), {}),
    # Dynamic NTK scaling past a context of 8 positions: the 16 tokens raise the rotary base 6.3-fold.
    "llama_dynamic": ("llama", dict(LLAMA_SHAPE, rope_theta=500.0, max_position_embeddings=8, rope_scaling={
        "rope_type": "dynamic", "factor": 4.0}), {}),
}
# Beside GPT-2 and Llama, whose training equivalence tests/test_equivalence.py holds: name -> the mesh to train on.
FAMILIES = {"qwen2": {"mesh.data": 2, "mesh.tensor": 2}, "qwen3": {"mesh.data": 2, "mesh.tensor": 2},
            "mistral": {"mesh.data": 2, "mesh.tensor": 2},
            "mixtral": {"mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2},
            "qwen3_moe": {"mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2},
            "qwen2_moe": {"mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2},
            "olmoe": {"mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2},
            "gemma2": {"mesh.data": 2, "mesh.tensor": 2, "mesh.sequence": 2},
            "gemma3": {"mesh.data": 2, "mesh.tensor": 2, "mesh.sequence": 2},
            "deepseek3": {"mesh.data": 2, "mesh.tensor": 2, "mesh.sequence": 2},
            "deepseek3_moe": {"mesh.data": 2, "mesh.tensor": 2, "mesh.expert": 2}}
MESHES = {"one device": {}, "data=4 x tensor=2": {"mesh.data": 4, "mesh.tensor": 2}}
CLI_BATCH = 8  # the training run below: batch 8 of GPT-2's 32 positions, built-in corpus, seed 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The saved models, random tokens, transformers' logits on them and its loss on the CLI run's first batch."""
  where = tmp_path_factory.mktemp("hf")
  tokens = np.random.default_rng(0).integers(0, VOCAB, (4, 16)).astype(np.int32)
  np.save(where / "tokens.npy", tokens)
  config = get_config("tiny")
  split = data.open_split(config.data, "train", vocab_size=VOCAB)
  rows = data.batch_rows(split, seed=config.seed, step=0, batch_size=CLI_BATCH,
                         seq_len=MODELS["gpt2"][1]["n_positions"])
  np.save(where / "inputs.npy", rows[:, :-1])
  np.save(where / "targets.npy", rows[:, 1:])
  jobs = []
  for seed, (name, (family, hf_config, save)) in enumerate(MODELS.items()):
    jobs.append({"make": family, "dir": str(where / name), "config": hf_config, "seed": seed, "save": save})
    jobs.append({"logits": str(where / name), "tokens": str(where / "tokens.npy"),
                 "out": str(where / f"{name}_logits.npy")})
  jobs.append({"modules": str(where / "deepseek3_mtp"), "tokens": str(where / "tokens.npy"),
               "out": str(where / "deepseek3_mtp_modules.npz")})
  jobs.append({"loss": str(where / "gpt2"), "inputs": str(where / "inputs.npy"),
               "targets": str(where / "targets.npy"), "out": str(where / "gpt2_loss.npy")})
  run_reference(jobs, where)
  return where


def imported(directory, devices, **overrides):
  """The config and layout an hf: directory sets up, and its weights placed on `devices`."""
  config = tiny_config(init_from=f"hf:{directory}", **overrides)
  pretrained = hf_checkpoint.open_init_from(config.init_from)
  config = set_fields(config, pretrained.model_fields(config))
  layout = plan(config, devices)
  return config, layout, pretrained.load_params(layout)


def logits(layout, params, tokens):
  @jax.jit
  def forward(params, tokens):
    with placed(placement.for_layout(layout)):
      model = nnx.merge(layout.graphdef, params)
      return model.predict(tokens)

  return np.asarray(forward(params, jax.device_put(tokens, layout.batch_sharding)))


# The tied Llama differs from the untied one only in where its head is read from, the linear scaling from
# llama3's in a division: one device is enough for them.
LOGIT_CASES = [(name, mesh) for name in MODELS for mesh in MESHES
               if name not in ("llama_tied", "llama_linear", "llama_yarn", "llama_dynamic") or not MESHES[mesh]]


@pytest.mark.parametrize("name, mesh", LOGIT_CASES)
def test_logits_match_transformers(reference, name, mesh):
  devices = jax.devices()[:1] if mesh == "one device" else jax.devices()
  _, layout, params = imported(reference / name, devices, **MESHES[mesh])
  ours = logits(layout, params, np.load(reference / "tokens.npy"))
  expected = np.load(reference / f"{name}_logits.npy")
  assert (reference / name / hf_checkpoint.WEIGHTS_INDEX).exists() == bool(MODELS[name][2])
  assert ours.shape[-1] == 384 and np.all(ours[..., VOCAB:] == np.finfo(np.float32).min)  # padding masked
  error = np.abs(ours[..., :VOCAB] - expected).max() / np.abs(expected).max()
  assert error < 1e-5, f"{name} on {mesh}: logits differ from transformers by {error:.2e} relative"


def test_prediction_modules_match_transformers_and_export_as_read(reference, tmp_path):
  """DeepSeek-V3's multi-token prediction modules (model/mtp.py), read from where its checkpoint holds them: each
  module's logits equal transformers' MtpModel's, and an export writes the modules' tensors back bit for bit."""
  _, layout, params = imported(reference / "deepseek3_mtp", jax.devices()[:1])
  assert layout.model.mtp_depth == 2
  expected = np.load(reference / "deepseek3_mtp_modules.npz")
  modules = prediction_logits(nnx.merge(layout.graphdef, params), np.load(reference / "tokens.npy"))
  for k, ours in enumerate(modules, 1):
    error = np.abs(np.asarray(ours)[..., :VOCAB] - expected[str(k)]).max() / np.abs(expected[str(k)]).max()
    assert error < 1e-5, f"module {k}: logits differ from transformers' MtpModel by {error:.2e} relative"
  target = hf_checkpoint.write(str(tmp_path / "out"), layout.model, jax.device_get(params))
  original, written = (load_file(str(d / hf_checkpoint.WEIGHTS)) for d in (reference / "deepseek3_mtp", target))
  held = [name for name in original if name.startswith(("model.layers.3.", "model.layers.4."))]
  assert any(".eh_proj." in name for name in held) and any(".experts." in name for name in held), held
  for name in held:
    if not name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
      assert np.array_equal(written[name], original[name]), name
  assert json.loads((target / "config.json").read_text())["num_mtp_layers"] == 2


@pytest.mark.parametrize("name", FAMILIES)
def test_imported_family_trains_alike_on_a_mesh(reference, name):
  """The imported weights' loss and gradients on data=2 x tensor=2 (x expert=2 for experts) equal one device's
  (float32)."""
  runs, mesh = [], FAMILIES[name]
  for devices, overrides in ((jax.devices()[:1], {}), (jax.devices()[:math.prod(mesh.values())], mesh)):
    config, layout, params = imported(reference / name, devices, **overrides)
    runs.append(gradients(layout, params, batch_at(config, layout, 0)))
  (loss, grads), (mesh_loss, mesh_grads) = runs
  assert abs(mesh_loss - loss) < 1e-5 * loss, (mesh_loss, loss)
  assert_tree_close(mesh_grads, grads, f"{name} on {mesh}")


def test_dynamic_rotary_scaling_reads_the_whole_sequence_on_its_shards(reference):
  """Dynamic NTK scaling's base follows the whole sequence's length (32 past a context of 8): a pipeline's stages,
  each holding half of the sequence, compare their shards' last positions, and train as one device does."""
  runs = []
  layouts = ({}, {"mesh.pipeline": 2, "mesh.sequence": 2, "mesh.data": 2, "model.num_layers": 2})
  for devices, overrides in zip((jax.devices()[:1], jax.devices()), layouts):
    config, layout, params = imported(reference / "llama_dynamic", devices, **overrides)
    assert config.model.rope_type == "dynamic" and config.model.rope_original_max_len == 8 < config.model.max_len
    runs.append(gradients(layout, params, batch_at(config, layout, 0)))
  (loss, grads), (mesh_loss, mesh_grads) = runs
  assert abs(mesh_loss - loss) < 1e-5 * loss, (mesh_loss, loss)
  assert_tree_close(mesh_grads, grads, "dynamic rotary scaling on pipeline=2 x sequence=2 x data=2")


def hub_cache(directory: Path, cache: Path) -> Path:
  """`directory` laid out as huggingface_hub's cache holds a download: its snapshot folder.

  Each file is stored once as blobs/<sha256>, and snapshots/<revision>/<name> is a relative
  symlink to it, so every file the snapshot names resolves outside the snapshot.
  """
  repo = cache / "models--meshlm--test"
  snapshot = repo / "snapshots" / ("0" * 40)
  (repo / "blobs").mkdir(parents=True)
  snapshot.mkdir(parents=True)
  for file in directory.iterdir():
    blob = hashlib.sha256(file.read_bytes()).hexdigest()
    (repo / "blobs" / blob).write_bytes(file.read_bytes())
    (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
  return snapshot


def test_the_hub_cache_layout_loads(reference, tmp_path):
  snapshot = hub_cache(reference / "llama_tied", tmp_path / "hub")
  assert (snapshot / hf_checkpoint.WEIGHTS_INDEX).is_symlink()
  assert len(list(snapshot.glob("model-*-of-*.safetensors"))) > 1
  _, layout, params = imported(snapshot, jax.devices()[:1])
  ours = logits(layout, params, np.load(reference / "tokens.npy"))[..., :VOCAB]
  expected = np.load(reference / "llama_tied_logits.npy")
  error = np.abs(ours - expected).max() / np.abs(expected).max()
  assert error < 1e-5, f"the hub cache's snapshot: logits differ from transformers by {error:.2e} relative"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_every_mesh_reads_the_same_bits(reference, name):
  _, _, single = imported(reference / name, jax.devices()[:1])
  overrides = {"mesh.data": 2, "mesh.pipeline": 2, "mesh.tensor": 2, "sharding.zero": 3}
  _, layout, sharded = imported(reference / name, jax.devices(), **overrides)
  assert jax.tree.leaves(sharded)[0].sharding.spec[0] == "pipeline"  # layers split over stages
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(sharded)),
                          jax.tree.leaves(jax.device_get(single))):
    assert np.array_equal(a, b), f"{jax.tree_util.keystr(path)} differs on {overrides}"


def test_training_starts_at_the_loss_transformers_computes(reference, tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
  command = [sys.executable, "train.py", f"--config.init_from=hf:{reference / 'gpt2'}", "--config.steps=1",
             "--config.log_every=1", f"--config.batch_size={CLI_BATCH}", "--config.mesh.data=4",
             "--config.mesh.tensor=2", "--config.eval_every=0", "--config.sample_tokens=0",
             f"--config.workdir={tmp_path}"]
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "initialising from" in result.stdout
  records = read_metrics(tmp_path)
  first = next(r["loss"] for r in records if r["step"] == 1)
  expected = float(np.load(reference / "gpt2_loss.npy"))
  assert abs(first - expected) < 1e-5 * expected, (first, expected)


def quantized_copies(source: Path, where: Path, block: tuple) -> tuple[Path, Path]:
  """`source` with every projection matrix stored as DeepSeek-V3 publishes its own, float8 e4m3 with a float32
  scale per block (the block's largest magnitude over 448, e4m3's largest), and the float32 checkpoint it
  decodes to, each entry times its block's scale (written here with np.repeat, apart from meshlm's reader)."""
  tensors, quantized, decoded = load_file(str(source / hf_checkpoint.WEIGHTS)), {}, {}
  for name, weight in tensors.items():
    if not name.endswith("proj.weight"):
      quantized[name] = decoded[name] = weight
      continue
    padded = np.pad(weight, [(0, -size % b) for size, b in zip(weight.shape, block)])
    blocks = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    scale = (np.abs(blocks).max((1, 3)) / 448.0).astype(np.float32)
    spread = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:weight.shape[0], :weight.shape[1]]
    stored = (weight / spread).astype(ml_dtypes.float8_e4m3fn)
    quantized[name], quantized[name + "_scale_inv"] = stored, scale
    decoded[name] = stored.astype(np.float32) * spread
  config = json.loads((source / "config.json").read_text())
  fp8 = {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}}
  for folder, weights, written in ((where / "fp8", quantized, fp8), (where / "decoded", decoded, config)):
    folder.mkdir()
    save_file(weights, str(folder / hf_checkpoint.WEIGHTS))
    (folder / "config.json").write_text(json.dumps(written))
  return where / "fp8", where / "decoded"


def test_fp8_block_scaled_weights_read_as_they_decode(reference, tmp_path):
  """DeepSeek-V3's published checkpoint stores its projections in float8 with a scale per 128 x 128 block; blocks of
  16 x 16 here (the 24-wide matrices end in half a block), read whole on one device and in shards on data=4 x
  tensor=2, equal the float32 checkpoint they decode to, bit for bit. Without its quantization_config, refused."""
  fp8, decoded = quantized_copies(reference / "deepseek3_mtp", tmp_path, (16, 16))
  for devices, mesh in ((jax.devices()[:1], {}), (jax.devices(), {"mesh.data": 4, "mesh.tensor": 2})):
    params = [jax.device_get(imported(folder, devices, **mesh)[2]) for folder in (fp8, decoded)]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params[0]), jax.tree.leaves(params[1])):
      assert np.array_equal(a, b), f"{jax.tree_util.keystr(path)} on {mesh or 'one device'}"
  config = json.loads((fp8 / "config.json").read_text())
  (fp8 / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
  with pytest.raises(ValueError, match=r"^\S+ stores model\.\S+ as float8 without a quantization_config in "
                                       r"config\.json; meshlm reads block-scaled fp8"):
    hf_checkpoint.open_init_from(f"hf:{fp8}")


def test_export_round_trips_bit_identically(reference, tmp_path):
  """import -> a meshlm checkpoint -> tools/export -> transformers loads exactly the weights it saved."""
  jobs = []
  for name in MODELS:
    config, layout, params = imported(reference / name, jax.devices()[:1],
                                      workdir=str(tmp_path / name / "run"))
    checkpoints = Checkpoints(config.workdir, every=0, keep=1)
    checkpoints.save_now(0, state_from_params(layout, params), config)
    checkpoints.close()
    export(config.workdir, str(tmp_path / name / "exported"))
    jobs.append({"compare": [str(reference / name), str(tmp_path / name / "exported")],
                 "out": str(tmp_path / f"{name}.json")})
  run_reference(jobs, tmp_path)
  for name in MODELS:
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["tensors"] > 10 and not (result["missing"] or result["unexpected"] or result["differ"]), result
    assert result["tied"][0] == result["tied"][1] and result["rope"][0] == result["rope"][1], result
    # meshlm trains without dropout, so the export must not let transformers fill in GPT-2's 0.1
    assert result["dropout"] and not any(result["dropout"].values()), result


def refused(config, says: str):
  with pytest.raises(ValueError, match=says) as raised:
    train(config)
  assert "\n" not in str(raised.value)
  assert not Path(config.workdir).exists(), "nothing is written for bad input"


def copy_with(source: Path, target: Path, *, config=None, tensors=None) -> Path:
  """A copy of an HF directory with its config.json fields and its tensors changed."""
  target.mkdir()
  hf_config = json.loads((source / "config.json").read_text())
  (target / "config.json").write_text(json.dumps({**hf_config, **(config or {})}))
  weights = load_file(source / "model.safetensors")
  save_file(tensors(weights) if tensors else weights, target / "model.safetensors", metadata={"format": "pt"})
  return target


def test_refuses_an_architecture_it_does_not_have(reference, tmp_path):
  directory = copy_with(reference / "gpt2", tmp_path / "bert", config={"architectures": ["BertForMaskedLM"]})
  refused(tiny_config(init_from=f"hf:{directory}", workdir=str(tmp_path / "run")),
          r"declares architectures \['BertForMaskedLM'\]; meshlm imports GPT2LMHeadModel, LlamaForCausalLM, "
          "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
          "OlmoeForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, DeepseekV3ForCausalLM, Qwen3MoeForCausalLM "
          "checkpoints")


def test_refuses_a_tensor_shaped_unlike_its_config(reference, tmp_path):
  name = "transformer.h.1.mlp.c_fc.weight"
  directory = copy_with(reference / "gpt2", tmp_path / "bad", tensors=lambda w: {**w, name: w[name][:, :100]})
  refused(tiny_config(init_from=f"hf:{directory}", workdir=str(tmp_path / "run")),
          rf"holds {name} with shape \(64, 100\), but its config.json declares \(64, 128\)")


def test_refuses_a_missing_weight(reference, tmp_path):
  name = "model.layers.1.self_attn.k_proj.weight"
  directory = copy_with(reference / "llama", tmp_path / "bad",
                        tensors=lambda w: {k: v for k, v in w.items() if k != name})
  refused(tiny_config(init_from=f"hf:{directory}", workdir=str(tmp_path / "run")),
          f"lacks the weight {name}, which its config.json declares")


def test_refuses_what_meshlm_does_not_compute(reference, tmp_path):
  directory = copy_with(reference / "llama", tmp_path / "scaled",
                        config={"rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0, "factor": 4.0}})
  refused(tiny_config(init_from=f"hf:{directory}", workdir=str(tmp_path / "run")),
          "sets rope_type='longrope', but meshlm computes rotary positions default, linear, llama3, yarn, dynamic only")
  deepseek = copy_with(reference / "llama", tmp_path / "deepseek", config={"rope_parameters": {
      "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
      "mscale_all_dim": 1.0}})
  refused(tiny_config(init_from=f"hf:{deepseek}", workdir=str(tmp_path / "run")),
          "sets yarn's mscale=1.0, but meshlm computes YaRN's attention factor from attention_factor or factor only")
  refused(tiny_config(init_from=str(directory), workdir=str(tmp_path / "run")), "use hf:<directory>")
  windowed = copy_with(reference / "qwen2", tmp_path / "windowed", config={"use_sliding_window": True})
  refused(tiny_config(init_from=f"hf:{windowed}", workdir=str(tmp_path / "run")),
          "sets use_sliding_window=True, but meshlm computes attention over the whole causal context")
  sparse = copy_with(reference / "qwen3_moe", tmp_path / "sparse", config={"decoder_sparse_step": 2})
  refused(tiny_config(init_from=f"hf:{sparse}", workdir=str(tmp_path / "run")),
          "sets decoder_sparse_step=2, but meshlm computes every feed-forward layer a mixture of experts")


@pytest.mark.parametrize("overrides, says", [
    ({"moe.experts": 4}, r"^meshlm's gpt2 with moe.experts=4, moe.shared_width=0 and model.sliding_window=0 has no "
                         r"Hugging Face architecture; export a llama"),
    ({"model.sliding_window": 8}, r"^meshlm's gpt2 with moe.experts=0, moe.shared_width=0 and model.sliding_window=8"),
    ({"model.family": "qwen2", "moe.experts": 4}, r"^meshlm's qwen2 with moe.experts=4, moe.shared_width=0"),
    ({"model.family": "llama", "moe.experts": 4, "moe.every": 2},
     r"^moe.every=2: MixtralForCausalLM makes every feed-forward layer a mixture of experts"),
    ({"model.family": "llama", "moe.experts": 4, "moe.renormalize": False},
     r"^moe.renormalize=False: Mixtral always renormalises its top-k router weights"),
])
def test_export_refuses_experts_transformers_cannot_hold(overrides, says):
  with pytest.raises(ValueError, match=says):
    hf_mapping.hf_config(model_config(tiny_config(**overrides)), tied=False)


def test_export_refuses_without_writing(tmp_path):
  with pytest.raises(ValueError, match="holds no checkpoint"):
    export(str(tmp_path / "run"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "keep.txt").write_text("mine")
  with pytest.raises(ValueError, match="already exists and is not an empty directory"):
    export(str(tmp_path / "run"), str(tmp_path / "taken"))
  assert os.listdir(tmp_path / "taken") == ["keep.txt"]
