"""Which parameters are hidden matrices, and which of their axes are the input and the output side.

A hidden matrix is a kernel of the blocks (or of the multi-token prediction
modules) whose `embed` axis comes first (its input: q, k, v, GPT-2's QKV, MLP
up and gate, the modules' merge) or last (its output: the
attention output, MLP down) among its matrix axes, the other matrix axes being
the other side; both sides grow with the width. A `latent` axis (latent attention's
compressed queries and keys, model/mla.py) counts as `embed` does. `layers`, `expert` and unnamed
axes (GPT-2's q/k/v) are batch axes: each layer, expert and projection is a
matrix of its own. A kernel with one side only (Qwen2-MoE's shared-expert gate,
embed -> 1) is a gate, not a matrix. Muon orthogonalises the hidden matrices
(training/muon.py); muP scales their initialisation and learning rate
(model/mup.py).
"""

import jax

from model.mtp import MTP
from model.stack import DENSE_STACKED, STACKED

BATCH_AXES = ("layers", "expert", None)  # axes along which a kernel holds separate matrices
WIDTH_AXES = ("embed", "latent")  # the axes that mark a matrix's input (first) or output (last) side


def matrix_sides(path, axes) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """(input axes, output axes) of a hidden matrix from its tree path and logical axes; None for any other."""
  keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  if keys[0] not in (STACKED, DENSE_STACKED, MTP) or not keys[-1].endswith("kernel"):
    return None
  matrix = [i for i, name in enumerate(axes) if name not in BATCH_AXES]
  names = [axes[i] for i in matrix]
  if names[0] in WIDTH_AXES:
    sides = (tuple(matrix[:1]), tuple(matrix[1:]))
  elif names[-1] in WIDTH_AXES:
    sides = (tuple(matrix[:-1]), tuple(matrix[-1:]))
  else:
    raise ValueError(f"Kernel {jax.tree_util.keystr(path)} (logical axes {tuple(axes)}) has no input and output "
                     "side that Muon and muP can tell: they read them off its `embed` (or `latent`) axis, first or "
                     "last among its matrix axes; name its axes so.")
  return sides if all(sides) else None  # one side only: a gate (embed -> 1), not a matrix
