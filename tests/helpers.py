"""What the tests share: the repository root, the tiny config, a run's metrics.jsonl records, and the
equivalence harness that holds a layout's loss, gradients and parameters to one device's."""

import dataclasses
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs.gpt2 import get_config
from configs.load import set_fields
from input_pipeline import data
from interop import hf_checkpoint
from model import mtp
from model.placement import placed
from model.stack import unit_of
from model.transformer import masked_vocab
from parallel import placement
from resilience.preemption import StopRequests
from training.state import abstract_inputs, param_draw, plan, state_from_params
from training.step import loss_and_grads, loss_fn, make_train_step

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(**overrides):
  """The tiny GPT-2 made smaller still, in float32, with dotted-path overrides."""
  c = get_config("tiny")
  c.model.num_layers, c.model.embed_dim, c.model.mlp_dim, c.model.max_len = 2, 64, 256, 32
  c.batch_size, c.steps, c.schedule.warmup_steps = 16, 10, 2
  return set_fields(c, overrides)


def stop_at(step: int) -> type:
  """StopRequests that a preemption reaches during `step`, as SIGTERM would: patched over run.loop's."""

  class StopAtStep(StopRequests):
    def requested(self, at_step, every):
      self.signal_name = "SIGTERM" if at_step == step else None
      return at_step == step

  return StopAtStep


def read_metrics(workdir):
  """Every record of the workdir's metrics.jsonl, in order."""
  return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


STEPS = 3  # warmup's lr = 0 at step 0, then two AdamW updates that see the moments of three gradients


def batch_at(config, layout, step):
  """Training batch `step` of the built-in corpus, laid out for the layout."""
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  return data.global_batch(split, seed=0, step=step, batch_size=config.batch_size,
                           seq_len=config.model.max_len, sharding=layout.batch_sharding)


_DRAWN = {}


def fresh_state(layout, seed):
  """init_state's step 0, its parameters drawn once per model on one device and put into the layout's shardings.
  The draw does not depend on the layout (test_model_init.py holds init_state on meshes to it), so this compiles
  it once per model and seed rather than once per layout (0.6 to 0.8 s each for the tiny model)."""
  dtypes = tuple((x.shape, x.dtype) for x in jax.tree.leaves(layout.abstract_state["params"]))
  # The loss's chunk follows each layout's tokens per device; the parameters never read it.
  key = (dataclasses.replace(layout.model, loss_chunk=1), seed, dtypes)
  if key not in _DRAWN:
    _DRAWN[key] = jax.device_get(jax.jit(param_draw(layout, seed))())
  return state_from_params(layout, jax.device_put(_DRAWN[key], layout.param_shardings), seed)


def setup(overrides, devices):
  """Config, layout, fresh state and the first batch for a layout."""
  config = tiny_config(**overrides)
  layout = plan(config, devices)
  return config, layout, fresh_state(layout, config.seed), batch_at(config, layout, 0)


def objective_and_gradients(layout, grad_accum=1):
  """The jitted (params, batch, loss scale) -> ((objective, statistics), gradients of scale x objective), traced
  as the train step traces them, over `grad_accum` micro-batches."""

  def run(params, batch, scale=None):
    with placed(placement.for_layout(layout)):
      return loss_and_grads(layout, params, batch, grad_accum, scale)

  return jax.jit(run)


def gradients(layout, params, batch):
  """Loss and gradients traced as the train step traces them."""
  (loss, _), grads = jax.device_get(objective_and_gradients(layout)(params, batch))
  return loss, grads


def loss_and_gradients(overrides, devices):
  _, layout, state, batch = setup(overrides, devices)
  return gradients(layout, state["params"], batch)


def assert_layout_matches(overrides, reference, what):
  """The loss and gradients of the first batch under `overrides` (on one device where mesh.data is 1, else on
  all eight) equal `reference`'s (loss, gradients) to 1e-5."""
  devices = jax.devices()[:1] if overrides.get("mesh.data") == 1 else jax.devices()
  loss, grads = loss_and_gradients(overrides, devices)
  np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
  assert_tree_close(grads, reference[1], f"gradient, {what}")


def prediction_logits(model, sequence_BS) -> list:
  """Each multi-token prediction module's float32 logits (model/mtp.py), written out by truncation rather than the
  model's masks: the stack reads sequence_BS[:, :-1], and module k runs on its first S - 1 - k positions, reading
  token i + k from the sequence (causal attention makes a prefix's hidden states those of the whole sequence).
  Module k's logits score sequence_BS[:, k + 1:]."""
  length = sequence_BS.shape[1] - 1
  hidden_BTD, _ = model.run_blocks(model.embed_tokens(sequence_BS[:, :-1]))
  hidden_BTD, out = model.final_norm(hidden_BTD), []
  for k in range(1, model.cfg.mtp_depth + 1):
    module = unit_of(getattr(model, mtp.MTP), k - 1)
    kept = length - k
    hidden_BTD, _ = module(hidden_BTD[:, :kept], model.embed_tokens(sequence_BS[:, k:k + kept]), jnp.arange(kept))
    out.append(masked_vocab(model.head_logits(hidden_BTD), model.cfg))  # the module's own norm, then the head
  return out


def train_steps(config, layout, state, steps):
  """`state` after the train steps on batches 0 .. steps - 1 (the state is donated)."""
  step = make_train_step(layout, config)
  for i in range(steps):
    state, _ = step(state, batch_at(config, layout, i))
  return state


def params_after_steps(overrides, devices, steps=STEPS):
  """The params after `steps` train steps from a fresh state on the layout (no gradient program compiled)."""
  config, layout, state, _ = setup(overrides, devices)
  return jax.device_get(train_steps(config, layout, state, steps)["params"])


def run_layout(overrides, devices):
  """Loss and gradients of the first batch, and the params after STEPS train steps, on the given layout."""
  config, layout, state, batch = setup(overrides, devices)
  loss, grads = gradients(layout, state["params"], batch)
  return loss, grads, jax.device_get(train_steps(config, layout, state, STEPS)["params"])


def assert_tree_close(actual, expected, what, tolerance=1e-5):
  """Each leaf within `tolerance` of its expected largest entry; the trees must have the same structure."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected), f"{what}: the trees differ"
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    scale = max(np.abs(e).max(), 1e-12)
    err = np.abs(a - e).max() / scale
    assert err < tolerance, f"{what} {jax.tree_util.keystr(path)}: relative error {err:.2e}"


# GPT-2's key bias has no gradient in exact arithmetic: q . b_k adds one constant to all of a query's
# scores, which the softmax cancels. In float32 its gradient is rounding noise (|g| ~ 1e-12) that AdamW
# divides by eps = 1e-8, moving it by ~lr x 1e-4 per update, differently on each layout: far below any
# real update (~lr), but not within 1e-5 of the query and value biases it shares a leaf with. It is
# held to this bound instead: two updates of at most lr |g| / eps = 3e-3 x 1e-11 / 1e-8 = 3e-6 each.
KEY_BIAS_BOUND = 1e-5


def without_key_bias(params, what):
  """`params` with GPT-2's key bias zeroed, once it is shown to be below KEY_BIAS_BOUND."""
  def strip(path, leaf):
    if not jax.tree_util.keystr(path).endswith("['qkv_bias']"):
      return leaf
    leaf = np.array(leaf)  # (..., q/k/v, heads, head_dim)
    assert np.abs(leaf[..., 1, :, :]).max() < KEY_BIAS_BOUND, f"{what}: the key bias moved like a weight"
    leaf[..., 1, :, :] = 0
    return leaf

  return jax.tree_util.tree_map_with_path(strip, params)


def assert_params_close(actual, expected, what):
  """assert_tree_close for parameters after training steps, the key bias held to KEY_BIAS_BOUND."""
  assert_tree_close(without_key_bias(actual, what), without_key_bias(expected, what), what)


# bfloat16 keeps 8 significant bits, so a value computed in it is rounded by up to 2^-8 relative, one way
# on one layout and the other way on another. The loss is float32 arithmetic on bfloat16 logits whose
# rounding errors average over the batch's 512 per-token losses: 2^-8 / sqrt(512) = 1.7e-4. A gradient
# of a weight is a float32-accumulated product of bfloat16 operands that may each differ by an ulp:
# within 2^-6 (4 ulps) of its largest entry (0.6% at most here). GPT-2's projection and MLP biases are
# added in bfloat16, so their gradients are sums over the batch's tokens in bfloat16 whose error grows
# with the count, and each layout sums in its own order: 11% here, held to 25% (a missing reduction over
# data would be 88%).
BF16_LOSS_RTOL = 2.0**-8 / np.sqrt(512)
BF16_GRADIENT_TOLERANCES = (2.0**-6, 0.25)  # (weights, biases added in bfloat16)
# float16 keeps 11 bits (2^-11), 8 times finer: by the same count the loss is held to 2^-11 / sqrt(512) and a
# weight's gradient to 4 ulps, 2^-9 (0.04% at most on the pipelined MoE of tests/test_pipeline.py); the biases
# added in float16 differ by 0.25% there, held to 2^-6 (1.6%).
FP16_LOSS_RTOL = 2.0**-11 / np.sqrt(512)
FP16_GRADIENT_TOLERANCES = (2.0**-9, 2.0**-6)


def assert_half_gradients_close(grads, ref_grads, what, tolerances=BF16_GRADIENT_TOLERANCES):
  """assert_tree_close at a half precision's `tolerances`: the weights', and the biases' (`*_bias`, added in it)."""
  def split(tree):
    added_in_half = lambda path: jax.tree_util.keystr(path).endswith("_bias']")
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ({jax.tree_util.keystr(p): x for p, x in flat if added_in_half(p)},
            {jax.tree_util.keystr(p): x for p, x in flat if not added_in_half(p)})

  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads), f"{what}: the trees differ"
  (biases, weights), (ref_biases, ref_weights) = split(grads), split(ref_grads)
  weight_tolerance, bias_tolerance = tolerances
  assert_tree_close(weights, ref_weights, what, weight_tolerance)
  assert_tree_close(biases, ref_biases, f"{what} (bias added in the compute dtype)", bias_tolerance)


def compiled_forward(layout, config):
  state, batch = abstract_inputs(layout, config)

  def forward(params, batch):
    with placed(placement.for_layout(layout)):
      return loss_fn(layout, params, batch)

  return jax.jit(forward).lower(state["params"], batch).compile()


def data_config(source="tokens", path=""):
  return ml_collections.ConfigDict(dict(source=source, path=str(path), prefetch=2))


def write_corpus(folder: Path) -> list[str]:
  """Writes a few text files (and some that are skipped); returns the texts in read order."""
  texts = {"b.txt": "héllo\r\nwörld", "a/c.md": "# title\n", "d.py": "print('日本')\n" * 50}
  for name, text in texts.items():
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(text.encode("utf-8"))
  (folder / "e.bin").write_bytes(b"\0\1\2")
  (folder / ".hidden").mkdir()
  (folder / ".hidden" / "x.txt").write_text("secret")
  return [texts[name] for name in ("a/c.md", "b.txt", "d.py")]


SIDECAR = ROOT / ".venv-hf" / "bin" / "python"
SETUP = ("PYENV_VERSION=3.11 python3 -m venv .venv-hf && "
         ".venv-hf/bin/pip install -r tests/hf_reference_requirements.txt")


def need_sidecar() -> None:
  """Skips a test that needs the transformers sidecar where it is missing; in CI, fails it instead."""
  if not SIDECAR.exists():
    message = f"the transformers sidecar {SIDECAR} is missing; set it up with: {SETUP}"
    if os.environ.get("CI"):
      pytest.fail(message)
    pytest.skip(message)


def run_reference(jobs: list, where: Path) -> None:
  """Run jobs in the transformers sidecar; in CI a missing sidecar fails the test instead of skipping it."""
  need_sidecar()
  jobs_file = where / "jobs.json"
  jobs_file.write_text(json.dumps(jobs))
  result = subprocess.run([str(SIDECAR), str(ROOT / "tests" / "hf_reference.py"), str(jobs_file)],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]


def wait_for(condition, timeout=120):
  deadline = time.time() + timeout
  while not condition():
    assert time.time() < deadline, "timed out"
    time.sleep(0.2)


def logged_steps(workdir):
  return [r["step"] for r in read_metrics(workdir)] if (workdir / "metrics.jsonl").exists() else []


def what_went_wrong(output: str) -> str:
  """The output's last 40 lines that say something: a crashed process's thread dump (one "File" line
  per frame, for every thread) would otherwise push the launcher's lines and XLA's message out of view."""
  bar = re.compile(r".*\d+%\|[^\]]*\]\s*")  # tqdm's progress bars, redrawn in front of the log lines
  noise = re.compile(r"\s*(File |Thread 0x|Current thread 0x|Extension modules:|\[Gloo\]|$)")
  lines = [bar.sub("", line) for line in output.splitlines()]
  return "\n".join([line for line in lines if not noise.match(line)][-40:])


LLAMA = {"model.family": "llama", "model.num_heads": 8, "model.kv_heads": 4, "model.mlp_dim": 192}


def qkv(t, s, heads=4, kv_heads=2, head_dim=8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (2, t, heads, head_dim)),
          jax.random.normal(keys[1], (2, s, kv_heads, head_dim)),
          jax.random.normal(keys[2], (2, s, kv_heads, head_dim)))


END_OF_TEXT = "<|endoftext|>"


def byte_level_bpe(texts: list, vocab_size: int):
  """A byte-level BPE (a `tokenizers.Tokenizer`) of at most `vocab_size` tokens trained on `texts`, with
  <|endoftext|> as its one special token, as GPT-2's and Llama 3's tokenizers are built."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # the `hf` extra
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return bpe


def pair_chunks(seed: int, count: int, vocab: int):
  """Random preference pairs as write_token_folder takes them: a shared prompt of 2..8 ids, answers of 1..9."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    prompt = rng.integers(1, vocab, rng.integers(2, 9))
    yield tuple((np.concatenate([prompt, answer]), np.concatenate([np.zeros(len(prompt)), np.ones(len(answer))]))
                for answer in (rng.integers(1, vocab, rng.integers(1, 10)) for _ in range(2)))


def hf_gradients(where: Path, model_config, grads) -> dict:
  """`grads` (meshlm's tree) under transformers' names, as tools/export.py would write them."""
  exported = hf_checkpoint.write(str(Path(tempfile.mkdtemp(dir=where)) / "gradients"), model_config, grads)
  return load_file(str(exported / "model.safetensors"))


def assert_hf_gradients_close(ours: dict, expected) -> None:
  """Each "grad:NAME" of the sidecar's `expected` npz equals ours[NAME] to 1e-5 of its largest entry."""
  names = {key.removeprefix("grad:") for key in expected.files if key.startswith("grad:")}
  assert names <= set(ours), names - set(ours)
  for name in names:
    theirs = expected[f"grad:{name}"]
    np.testing.assert_allclose(ours[name].reshape(theirs.shape), theirs, rtol=0,
                               atol=1e-5 * np.abs(theirs).max(), err_msg=name)


def markdown_tables(markdown: str) -> list[list[dict]]:
  """Each markdown table in `markdown` (tables are separated by any line that is not a table row), as its rows'
  {column: cell} dicts."""
  tables, lines = [], []
  for line in [*markdown.splitlines(), ""]:
    if line.startswith("|"):
      lines.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    elif lines:
      tables.append([dict(zip(lines[0], row)) for row in lines[2:]])
      lines = []
  return tables
