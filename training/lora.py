"""LoRA: low-rank adapters on chosen projections, the model's weights frozen (config.lora).

Each targeted kernel W (a stacked layer's, an expert's: its `layers` and `expert` axes lead) gains two factors,
A over W's input axes and B over its output axes with `rank` between them, and the model computes with
W + (alpha / rank) A B. W's input is the `embed` axis where W starts with it (q, k, v, the MLP's up and gate), its
output where W ends with it (the attention's output and the MLP's down projection). A and B take W's own logical
axes, so they lie sharded as W does (tensor parallelism splits B of a column-parallel kernel by heads, A of a
row-parallel one; ZeRO-3 splits what `embed` names). B starts at zero and A as PEFT's kaiming-uniform, so a run
starts at exactly its base model.

The train state holds the frozen weights as "params" and the factors as "adapters": gradients, the optimizer's
moments and its update are the adapters' alone. The merged weights exist inside the step only, one matrix product
per kernel per step (rank x its size FLOPs), negligible beside the tokens'.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

GROUPS = {"attention": ("qkv", "q", "k", "v", "out"), "mlp": ("up", "gate", "down")}
KERNELS = tuple(name for names in GROUPS.values() for name in names)
LEAD_AXES = ("layers", "expert")  # axes a factor keeps whole: one adapter per layer and per expert
ADAPTERS = "adapters"
A, B = "a_kernel", "b_kernel"  # each adapted kernel's factors (kernels by name: weight decay applies)
FROZEN_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Lora:
  """The settings of LoRA (config.lora)."""
  rank: int
  alpha: float
  kernels: tuple[str, ...]
  frozen_dtype: str = "float32"  # the frozen matrices' dtype (vectors stay float32)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def settings(config) -> Lora | None:
  """config's LoRA, or None when every weight trains; refuses unknown targets in one line."""
  if not config.lora.rank:
    return None
  names = [name.strip() for name in config.lora.targets.split(",") if name.strip()]
  unknown = [name for name in names if name not in GROUPS and name not in KERNELS]
  if unknown or not names:
    raise ValueError(f"lora.targets={config.lora.targets!r} names {unknown or 'nothing'}; give a comma list of "
                     f"{', '.join(GROUPS)} or kernels ({', '.join(KERNELS)}).")
  kernels = tuple(dict.fromkeys(k for name in names for k in GROUPS.get(name, (name,))))
  if config.lora.frozen_dtype not in FROZEN_DTYPES:
    raise ValueError(f"lora.frozen_dtype={config.lora.frozen_dtype!r} is not one of {', '.join(FROZEN_DTYPES)}; "
                     "bfloat16 halves the frozen weights' memory.")
  return Lora(rank=config.lora.rank, alpha=float(config.lora.alpha), kernels=kernels,
              frozen_dtype=config.lora.frozen_dtype)


def frozen_dtype(lora: Lora | None, ndim: int):
  """The dtype a frozen weight of `ndim` axes is stored in: matrices (kernels, embeddings) in lora.frozen_dtype,
  vectors (norm scales, biases: a small part of the bytes) in float32, as QLoRA keeps them; float32 without LoRA."""
  return jnp.dtype(lora.frozen_dtype if lora is not None and ndim >= 2 else jnp.float32)


def frozen(lora: Lora, params: dict) -> dict:
  """The frozen parameters' ShapeDtypeStructs, each in frozen_dtype."""
  return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, frozen_dtype(lora, p.ndim)), params)


def split_axes(axes: tuple) -> tuple[int, int] | None:
  """(leading axes, input axes after them) of a kernel's logical axes, or None when `embed` neither begins nor
  ends what follows the leading ones."""
  lead = 0
  while lead < len(axes) and axes[lead] in LEAD_AXES:
    lead += 1
  rest = axes[lead:]
  if rest and rest[0] == "embed":
    return lead, 1
  if rest and rest[-1] == "embed":
    return lead, len(rest) - 1
  return None


def _keys(path) -> tuple:
  """A tree path's keys: dict keys, and the layer numbers of a stack of several layer kinds."""
  return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)


def targeted(lora: Lora, logical: dict) -> dict:
  """{path (a tuple of keys): (leading axes, input axes)} of the kernels `lora` adapts, from the parameters'
  logical PartitionSpecs; refuses a setting that adapts none."""
  found = {}
  for path, spec in jax.tree_util.tree_leaves_with_path(logical, is_leaf=lambda x: isinstance(x, P)):
    name = str(getattr(path[-1], "key", ""))
    if name.endswith("_kernel") and name.removesuffix("_kernel") in lora.kernels:
      split = split_axes(tuple(spec))
      if split is not None:
        found[_keys(path)] = split
  if not found:
    raise ValueError(f"lora.targets names kernels ({', '.join(lora.kernels)}) this model does not have; its "
                     "projections are among " + ", ".join(KERNELS) + ".")
  return found


def _nest(flat: dict) -> dict:
  tree = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def _leaf(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def abstract_adapters(lora: Lora, params: dict, logical: dict) -> tuple[dict, dict]:
  """(the adapters' ShapeDtypeStructs, their logical PartitionSpecs), each a tree {kernel's path: {A, B}}."""
  shapes, specs = {}, {}
  for path, (lead, inputs) in targeted(lora, logical).items():
    kernel, axes = _leaf(params, path), tuple(_leaf(logical, path))
    cut = lead + inputs
    # float32 whatever the frozen base's dtype: the adapters are the trained (master) weights
    shapes[path] = {A: jax.ShapeDtypeStruct((*kernel.shape[:cut], lora.rank), jnp.float32),
                    B: jax.ShapeDtypeStruct((*kernel.shape[:lead], lora.rank, *kernel.shape[cut:]), jnp.float32)}
    specs[path] = {A: P(*axes[:cut], None), B: P(*axes[:lead], None, *axes[cut:])}
  return _nest(shapes), _nest(specs)


def initial(lora: Lora, params: dict, logical: dict, seed: int) -> dict:
  """Fresh adapters: A as PEFT draws it (kaiming-uniform with a = sqrt 5: uniform within 1 / sqrt(fan-in)), B zero."""
  abstract, _ = abstract_adapters(lora, params, logical)
  kernels = targeted(lora, logical)
  made = {}
  for key, (path, (lead, inputs)) in zip(jax.random.split(jax.random.key(seed), len(kernels)), kernels.items()):
    pair = _leaf(abstract, path)
    bound = 1 / math.sqrt(math.prod(pair[A].shape[lead:lead + inputs]))
    made[path] = {A: jax.random.uniform(key, pair[A].shape, pair[A].dtype, -bound, bound),
                  B: jnp.zeros(pair[B].shape, pair[B].dtype)}
  return _nest(made)


def merged(lora: Lora, params: dict, adapters: dict) -> dict:
  """`params` with each adapted kernel W replaced by W + scale x A B, in the adapters' dtype (a bfloat16 W is
  widened: the sum keeps the adapters' small updates)."""
  def merge(path, w):
    try:
      pair = _leaf(adapters, _keys(path))
    except KeyError:  # a weight LoRA leaves alone
      return w
    a, b = pair[A], pair[B]
    lead = a.ndim + b.ndim - 2 - w.ndim  # A and B share the leading axes and the rank, which W lacks
    # One letter per axis, none reshaped: a split axis (heads over `tensor`) keeps its sharding through the product.
    names = iter("abcdefghijklmnopqstuvwxyz")
    leading, inputs, outputs = ("".join(next(names) for _ in range(n))
                                for n in (lead, a.ndim - 1 - lead, b.ndim - 1 - lead))
    product = jnp.einsum(f"{leading}{inputs}r,{leading}r{outputs}->{leading}{inputs}{outputs}", a, b)
    return w.astype(a.dtype) + lora.scale * product
  return jax.tree_util.tree_map_with_path(merge, params)
