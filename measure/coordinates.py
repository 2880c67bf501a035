"""muP's coordinate check: how big activations get over the first steps of Adam, at several widths.

Each width trains the tiny model (heads of 16, the MLP 4x the width) for a few steps at one learning rate,
under the standard parametrisation and under muP with the narrowest width as its base (model/mup.py). After
each step it measures the RMS of one batch's coordinates: the last block's output (the residual stream
before the final norm) and the logits. Under the standard parametrisation they grow with the width as
training moves them (each update of a hidden matrix sums over as many inputs as the width); under muP
they stay flat, which is what lets a learning rate tuned narrow serve wide. tools/mup_coord_check.py
prints and draws them.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from configs import load
from input_pipeline import data
from training.state import init_state, plan
from training.step import make_train_step

HEAD_WIDTH = 16
PARAMETRISATIONS = ("standard", "muP")


def width_config(width: int, base: int, mup: bool, lr: float):
  """The tiny GPT-2 at `width`, muP against `base` or not, trained by AdamW at a constant `lr`."""
  return load.set_fields(load.load("configs/gpt2.py:tiny"), {
      "model.embed_dim": width, "model.num_heads": width // HEAD_WIDTH, "model.mlp_dim": 4 * width,
      "mup.base_width": base if mup else 0, "optimizer.lr": lr, "optimizer.clip_norm": 0.0,
      "schedule.warmup_steps": 0, "schedule.decay": "constant", "precision.compute": "float32", "batch_size": 8})


def coordinate_sizes(width: int, base: int, mup: bool, lr: float, steps: int) -> list[tuple[float, float]]:
  """(RMS of the last block's output, RMS of the logits) on batch 0, after each of `steps` steps."""
  config = width_config(width, base, mup, lr)
  layout = plan(config, jax.devices()[:1])
  split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  batch = lambda step: data.global_batch(split, seed=0, step=step, batch_size=config.batch_size,
                                         seq_len=config.model.max_len, sharding=layout.batch_sharding)

  @jax.jit
  def sizes(params, tokens):
    model = nnx.merge(layout.graphdef, params)
    hidden, _ = model.run_blocks(model.embed_tokens(tokens), tokens_BT=tokens)
    rms = lambda x: jnp.sqrt(jnp.mean(jnp.square(x)))
    return rms(hidden), rms(model.logits(hidden)[..., :config.model.vocab_size])

  train_step, state, probe = make_train_step(layout, config), init_state(layout, config.seed), batch(0)["inputs"]
  out = []
  for step in range(steps):
    state, _ = train_step(state, batch(step))
    out.append(tuple(float(x) for x in sizes(state["params"], probe)))
  return out


def check(widths: list[int], lr: float, steps: int) -> dict:
  """{parametrisation: {width: [(hidden RMS, logits RMS) per step]}}, muP's base the narrowest width."""
  return {name: {w: coordinate_sizes(w, min(widths), name == "muP", lr, steps) for w in widths}
          for name in PARAMETRISATIONS}
