"""muP's coordinate check (measure/coordinates.py) at several widths, as a table and a figure.

  python tools/mup_coord_check.py --widths 64,128,256,512 --steps 5 --write docs

The table is printed last; --write puts it, the figure and the command in docs/research.md's
mup_coord_check block.
"""

import platform
from importlib import metadata
from pathlib import Path

from absl import app, flags

from measure.coordinates import check
from measure.doc_blocks import replace_block


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
