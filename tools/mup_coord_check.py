"""muP's coordinate check: how big activations get over the first steps of Adam, at several widths.

  python tools/mup_coord_check.py --widths 64,128,256,512 --steps 5 --write docs

Each width trains the tiny model (heads of 16, the MLP 4x the width) for a few steps at one learning rate,
under the standard parametrisation and under muP with the narrowest width as its base (model/mup.py). After
each step it measures the RMS of one batch's coordinates: the last block's output (the residual stream
before the final norm) and the logits. Under the standard parametrisation they grow with the width as
training moves them (each update of a hidden matrix sums over as many inputs as the width); under muP
they stay flat, which is what lets a learning rate tuned narrow serve wide. The table is printed last;
--write puts it, the figure and the command in docs/research.md's mup_coord_check block.
"""

import platform
import sys
from importlib import metadata
from pathlib import Path

# `python tools/mup_coord_check.py` puts tools/ on sys.path, not the repo root that holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position

from configs import load  # pylint: disable=wrong-import-position
from input_pipeline import data  # pylint: disable=wrong-import-position
from tools.doc_blocks import replace_block  # pylint: disable=wrong-import-position
from training.state import init_state, plan  # pylint: disable=wrong-import-position
from training.step import make_train_step  # pylint: disable=wrong-import-position

HEAD_WIDTH = 16
PARAMETRISATIONS = ("standard", "muP")


def width_config(width: int, base: int, mup: bool, lr: float):
  """The tiny GPT-2 at `width`, muP against `base` or not, trained by AdamW at a constant `lr`."""
  config = load.load("configs/gpt2.py:tiny")
  config.model.embed_dim, config.model.num_heads, config.model.mlp_dim = width, width // HEAD_WIDTH, 4 * width
  config.mup.base_width = base if mup else 0
  config.optimizer.lr, config.optimizer.clip_norm = lr, 0.0
  config.schedule.warmup_steps, config.schedule.decay = 0, "constant"
  config.precision.compute, config.batch_size = "float32", 8
  return config


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
    hidden, _ = model.run_blocks(model.embed_tokens(tokens))
    rms = lambda x: jax.numpy.sqrt(jax.numpy.mean(jax.numpy.square(x)))
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


def table(sizes: dict) -> str:
  widths = list(next(iter(sizes.values())))
  lines = ["| parametrisation | after step | " + " | ".join(f"width {w}: block out / logits" for w in widths) + " |",
           "| --- | --- |" + " --- |" * len(widths)]
  for name, by_width in sizes.items():
    for step in range(len(by_width[widths[0]])):
      cells = [f"{by_width[w][step][0]:.3f} / {by_width[w][step][1]:.3f}" for w in widths]
      lines.append(f"| {name} | {step + 1} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(sizes: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  figure, axes = plt.subplots(1, 4, figsize=(12.8, 3.2), dpi=100, sharex=True)
  for column, (name, by_width) in enumerate(sizes.items()):
    widths = list(by_width)
    for which, label in enumerate(("last block's output", "logits")):
      ax = axes[2 * column + which]
      for step in range(len(by_width[widths[0]])):
        ax.plot(widths, [by_width[w][step][which] for w in widths], "o-", ms=3, label=f"step {step + 1}")
      ax.set(xscale="log", yscale="log", xlabel="width", title=f"{name}: {label}")
      ax.minorticks_off()  # the log axes' minor labels would cover the widths'
      ax.set_xticks(widths, [str(w) for w in widths])
      ax.grid(alpha=0.3)
  axes[0].set_ylabel("RMS of the coordinates")
  axes[-1].legend(fontsize=7, frameon=False)
  figure.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path)
  plt.close(figure)


_WIDTHS = flags.DEFINE_list("widths", ["64", "128", "256", "512"], "Model widths; the narrowest is muP's base.")
_STEPS = flags.DEFINE_integer("steps", 5, "AdamW steps.")
_LR = flags.DEFINE_float("lr", 1e-2, "The constant learning rate, the same at every width.")
_WRITE = flags.DEFINE_string("write", "", "A docs folder: write mup_coord_check.png there and the table into "
                              "its research.md's mup_coord_check block; empty: print only.")


def main(argv):
  del argv
  sizes = check([int(w) for w in _WIDTHS.value], _LR.value, _STEPS.value)
  text = table(sizes)
  if _WRITE.value:
    docs = Path(_WRITE.value)
    plot(sizes, docs / "mup_coord_check.png")
    command = " ".join(["python tools/mup_coord_check.py", f"--widths {','.join(_WIDTHS.value)}",
                        f"--steps {_STEPS.value}", f"--write {_WRITE.value}"])
    made = (f"Made by `{command}` at lr {_LR.value:g} (jax {metadata.version('jax')}, {platform.machine()}, "
            "float32 on one CPU device).")
    page = docs / "research.md"
    page.write_text(replace_block(page.read_text(), "mup_coord_check",
                                  f"{text}\n![mup coordinate check](mup_coord_check.png)\n\n{made}\n"))
  print(text, end="")


if __name__ == "__main__":
  app.run(main)
