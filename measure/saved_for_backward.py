"""What autodiff keeps for the backward pass of one layer, value by value, per token in D-units.

The model's own block, taken from the built model's stack (one layer's
parameters sliced) and run as scan_blocks runs it, under model.remat and the
compute dtype, is traced through jax.vjp (never compiled): every value the
pullback holds is listed with the model line that made it. Values that do not
depend on the layer's input are left out: the weights, their casts to the
compute dtype and the positions are the same for every token. A D-unit is one
bfloat16 vector of the model's width per token, 2 x embed_dim bytes.

A kernel other than xla (cuDNN's, which a CPU cannot trace, or splash's) is
traced as the xla kernel, and attention's own values (what the kernel reads or
makes) are replaced by the rule every flash kernel follows: it keeps q, k, v,
its output and the float32 log-sum-exp of each query's scores.
"""

import collections
import dataclasses
import linecache
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jax_core

from model.attention import kernel
from model.config import ModelConfig
from model.stack import scan_blocks
from training.state import build_model

ROOT = Path(__file__).resolve().parent.parent
ATTENTION_FILE = str(ROOT / "model" / "attention.py")
BFLOAT16_BYTES = 2
F32_BYTES = 4
# checkpoint_name and reduce_precision make a new variable for the same buffer: the value is their input's
ALIASES = ("name", "reduce_precision")
SOURCE_WIDTH = 72  # characters of the model line shown for each value


@dataclasses.dataclass(frozen=True)
class Saved:
  """`count` values of the same type made by the same line, each `bytes` per token of the traced layer."""
  source: str
  type: str
  bytes: float
  count: int = 1
  host: bool = False  # offloaded to pinned host memory by the remat policy

  @property
  def total(self) -> float:
    return self.bytes * self.count


@dataclasses.dataclass(frozen=True)
class Budget:
  """What one layer of `cfg` keeps per token for its backward pass; `rule` names a kernel counted by rule."""
  cfg: ModelConfig
  saved: tuple[Saved, ...]
  rule: str = ""

  @property
  def d_unit(self) -> int:
    return BFLOAT16_BYTES * self.cfg.embed_dim

  @property
  def per_layer(self) -> float:
    """Device bytes per token per layer (a unit of several layers, MoE's, is averaged over them)."""
    return sum(s.total for s in self.saved if not s.host) / self.cfg.layers_per_unit

  def units(self, nbytes: float) -> float:
    return nbytes / self.d_unit


def budget(cfg: ModelConfig, backend: str = "") -> Budget:
  """The values one layer of `cfg` keeps for its backward pass, with model.attention=auto resolved as on
  `backend` (default: the one jax runs on), traced on one sequence of model.max_len tokens."""
  chosen = kernel(cfg, backend or jax.default_backend())
  traced = dataclasses.replace(cfg, attention="xla", scan_layers=False)  # the modules keep their own copy
  with nnx.use_eager_sharding(False):
    graphdef, stack = nnx.split(nnx.eval_shape(lambda: build_model(traced, 0)).blocks)
  one_unit = jax.tree.map(lambda p: jax.ShapeDtypeStruct((1, *p.shape[1:]), p.dtype), stack)
  # One unit has no U-net halves and no first and last layers to give value tables: the model's own count both.
  unit = dataclasses.replace(traced, num_layers=cfg.layers_per_unit, unet_skips=False, value_embeds=0)
  run = lambda params, x: scan_blocks(nnx.merge(graphdef, params), x, jnp.arange(cfg.max_len), unit)[0]
  x = jax.ShapeDtypeStruct((1, cfg.max_len, cfg.embed_dim), cfg.dtype)
  closed, (_, pullback) = jax.make_jaxpr(lambda *args: jax.vjp(run, *args), return_shape=True)(one_unit, x)
  jaxpr = closed.jaxpr
  kept = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(pullback)):]
  # Under a remat policy the kernel's own values are recomputed, whichever kernel: the trace stands.
  rule = chosen if chosen != "xla" and cfg.remat == "none" else ""
  return Budget(cfg, _grouped(_kept_activations(jaxpr, kept, cfg, rule), cfg.max_len), rule)


def _kept_activations(jaxpr, kept, cfg: ModelConfig, rule: str) -> list:
  """(aval, source) of each distinct kept value that depends on the layer's input (the last argument), in the
  order the forward pass makes them; with a `rule` (a kernel's name), attention's own values (those the
  kernel reads or makes) replaced by the rule's where the first of them was."""
  alias, names, attention = {}, {}, set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ALIASES and not isinstance(eqn.invars[0], jax_core.Literal):
      alias[eqn.outvars[0]] = eqn.invars[0]
      names.update({eqn.invars[0]: eqn.params["name"]} if "name" in eqn.params else {})
    if rule and _inside_attention(eqn):
      attention.update(v for v in (*eqn.invars, *eqn.outvars) if not isinstance(v, jax_core.Literal))
  look_through = lambda v: look_through(alias[v]) if v in alias else v
  distinct = {look_through(v) for v in kept if not isinstance(v, jax_core.Literal)}
  named = lambda v: f" (named {names[v]!r})" if v in names else ""
  x = jaxpr.invars[-1]
  found, depends = ([(x.aval, "the block's input" + named(x))] if x in distinct else []), {x}
  for eqn in jaxpr.eqns:
    if any(v in depends for v in eqn.invars if not isinstance(v, jax_core.Literal)):
      depends.update(eqn.outvars)
    for v in (v for v in eqn.outvars if v in distinct and v in depends):
      if v not in attention:
        found.append((v.aval, _line(eqn) + named(v)))
      elif rule:  # the first of attention's values: the rule's in their place, once
        found += _attention_by_rule(cfg, rule)
        rule = ""
  return found


def _inside_attention(eqn) -> bool:
  """Whether the equation was traced inside model/attention.py's `attention`, the call of the kernel."""
  frames = eqn.source_info.traceback.frames if eqn.source_info.traceback else []
  return any(f.file_name == ATTENTION_FILE and f.function_name == "attention" for f in frames)


def _line(eqn) -> str:
  """The repository line that made the equation (its innermost frame in this repository), its primitive
  and the start of its text; else the function its traceback starts in (a value jax made again, as a
  recomputed activation's output, can carry only jax's own frames)."""
  frames = eqn.source_info.traceback.frames if eqn.source_info.traceback else []
  frame = next((f for f in frames if f.file_name.startswith(str(ROOT)) and "/.venv" not in f.file_name), None)
  if frame is None:
    return f"{eqn.primitive.name} in {frames[-1].function_name}" if frames else eqn.primitive.name
  text = linecache.getline(frame.file_name, frame.line_num).strip()
  text = text if len(text) <= SOURCE_WIDTH else text[:SOURCE_WIDTH - 3] + "..."
  return f"{Path(frame.file_name).relative_to(ROOT)}:{frame.line_num} {eqn.primitive.name}: {text}"


def _grouped(values, tokens: int) -> tuple[Saved, ...]:
  """Values of the same type from the same line as one Saved with a count, in the order first seen."""
  counts = collections.Counter((source, aval) for aval, source in values)
  return tuple(Saved(source, aval.str_short(short_dtypes=True), aval.size * aval.dtype.itemsize / tokens, count,
                     getattr(aval, "memory_space", None) == jax.memory.Space.Host)
               for (source, aval), count in counts.items())


def _attention_by_rule(cfg: ModelConfig, chosen: str) -> list:
  """(aval, source) of what a flash kernel keeps: q, k, v and its output in the compute dtype, and the float32
  log-sum-exp of each query's scores (jax's cuDNN rule keeps these five; splash the same)."""
  t, n, k, h = cfg.max_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  rows = [("q", (1, t, n, h), cfg.dtype), ("k", (1, t, k, h), cfg.dtype), ("v", (1, t, k, h), cfg.dtype),
          ("output", (1, t, n, h), cfg.dtype), ("log-sum-exp", (1, n, t), jnp.float32)]
  return [(jax.core.ShapedArray(shape, dtype), f"{chosen} attention's {what} (by rule)") for what, shape, dtype in rows]


def format_budget(b: Budget, layers: int, tokens: int, temporaries: int | None = None, tensor: int = 1) -> str:
  """The table of `b`, its total per token per layer, and the step's: x `layers` x `tokens` per device,
  beside the compiled step's `temporaries` bytes when given."""
  cfg = b.cfg
  lines = [f"saved for the backward pass, per token of one layer (jax.vjp of the {cfg.family} block traced at "
           f"{cfg.max_len} positions, remat {cfg.remat}, {jnp.dtype(cfg.dtype).name}; a D-unit is one bfloat16 "
           f"vector of the width, {b.d_unit:,} bytes; weights and positions left out):"]
  if b.rule:
    lines.append(f"  model.attention={b.rule} is traced as the xla kernel (a CPU cannot trace cuDNN's), and "
                 "attention's own values are counted by rule: q, k, v, output, log-sum-exp")
  lines.append(f"{'D-units':>9}{'bytes/token':>13}  {'value':<28}made by")
  for s in b.saved:
    count = f"{s.count} x " if s.count > 1 else ""
    lines.append(f"{b.units(s.total):9.2f}{s.total:13,.0f}  {count + s.type:<28}{s.source}{' [host]' * s.host}")
  host = sum(s.total for s in b.saved if s.host) / cfg.layers_per_unit
  lines.append(f"{b.units(b.per_layer):9.2f}{b.per_layer:13,.0f}  total per token per layer on the device"
               + (f" ({host:,.0f} bytes more in host memory)" if host else ""))
  beside = "" if temporaries is None else f", beside the compiled step's temporaries {temporaries / 2**20:,.1f} MiB"
  split = f" (the whole layer's values: mesh.tensor={tensor} splits the heads' and the MLP's)" if tensor > 1 else ""
  lines.append(f"step: {b.per_layer:,.0f} bytes x {layers} layers x {tokens:,} tokens per device = "
               f"{b.per_layer * layers * tokens / 2**20:,.1f} MiB{split}{beside}")
  return "\n".join(lines)
