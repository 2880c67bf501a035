"""Hugging Face checkpoint directories in and out: read straight onto the mesh, write for `from_pretrained`.

Import (`--config.init_from=hf:DIR`) reads config.json as `config.model` fields,
checks every tensor's name and shape against the model they make, then places each weight with
`jax.make_array_from_callback`: every device's block is read on its own from
the memory-mapped safetensors files (safetensors' numpy API reads only the
slice asked for), so no device ever holds more than its shard, and the host
at most one weight's distinct blocks at a time. Tensors meshlm does not use
(GPT-2's stored attention masks, a tied copy of the head) are ignored.
Which tensor is which weight: interop/hf_mapping.py.
"""

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from configs.load import with_fields
from interop import fp8_weights, hf_mapping
from model.config import ModelConfig
from model.mtp import MTP
from model.stack import DENSE_STACKED, STACKED
from training.state import Layout, model_config
from training.validate import cannot_hold_files

STACKS = (STACKED, DENSE_STACKED, MTP)  # the parameters with a leading layer axis

SCHEME = "hf:"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # names the file of each tensor when save_pretrained shards
RESAVE = "load the model in transformers and save_pretrained it again"  # what mends a damaged directory


class HFCheckpoint:
  """A Hugging Face checkpoint directory whose config meshlm can run and whose tensors it has checked."""

  def __init__(self, directory: Path, fields: dict, tied: bool, files: dict, shapes: dict, context: int,
               quantized: frozenset = frozenset(), block: tuple | None = None):
    self.directory, self.fields, self.tied, self.context = directory, fields, tied, context
    self.files, self.shapes = files, shapes  # tensor name -> its safetensors file, its shape
    self.quantized, self.block = quantized, block  # float8 matrices beside their scales, and a scale's block

  def model_fields(self, config) -> dict:
    """The model record the checkpoint decides: its shape as dotted config fields ("model.NAME", and
    "moe.NAME" for the experts), refusing tensors that do not fit it; `config` is left as it was."""
    fields = {field if "." in field else f"model.{field}": value for field, value in self.fields.items()}
    cfg = model_config(with_fields(config, fields))
    for name, shape in _expected_shapes(cfg, self.tied).items():
      stored = self._stored_name(name)
      if stored is None:
        raise ValueError(f"{self.directory} lacks the weight {name}, which its config.json declares.")
      if self.shapes[stored] != shape:
        raise ValueError(f"{self.directory} holds {stored} with shape {self.shapes[stored]}, but its "
                         f"config.json declares {shape}.")
    return fields

  def describe(self, cfg: ModelConfig) -> str:
    experts = f", {cfg.num_experts} experts (top {cfg.moe_top_k})" if cfg.num_experts else ""
    return (f"{self.directory}: {cfg.family}, {cfg.num_layers} layers, {cfg.num_heads} heads, width "
            f"{cfg.embed_dim}{experts}, vocabulary {cfg.vocab_size} (padded to {cfg.padded_vocab})")

  def load_params(self, layout: Layout) -> dict:
    """The checkpoint's weights as the params pytree, each array placed in its sharding."""
    cfg, abstract = layout.model, layout.abstract_state["params"]
    table = hf_mapping.tensors(cfg, self.tied)
    paths = {_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)}
    if cfg.mtp_depth and not any(path[0] == MTP for path in table):
      raise ValueError(f"model.mtp_depth={cfg.mtp_depth}: {cfg.family}'s Hugging Face checkpoints hold no prediction "
                       "modules (DeepseekV3ForCausalLM's do); start from this one with model.mtp_depth=0.")
    if paths != table.keys():
      raise ValueError(f"meshlm's {cfg.family} holds weights no Hugging Face tensor maps to: "
                       f"{sorted(paths ^ table.keys())[:3]}; interop/hf_mapping.py needs them.")
    with contextlib.ExitStack() as stack:
      opened = {f: stack.enter_context(safe_open(f, framework="np")) for f in set(self.files.values())}

      def read(name: str, index: tuple) -> np.ndarray:
        stored = self._stored_name(name)
        if stored in self.quantized:  # DeepSeek-V3's published projections: float8 with a scale per block
          scale = stored + fp8_weights.SCALE_SUFFIX
          return fp8_weights.read(self.files[stored], stored, opened[self.files[scale]].get_tensor(scale), index,
                                  self.block)
        return opened[self.files[stored]].get_slice(stored)[index]

      def place(path, leaf, sharding):
        tensor = table[_path(path)]
        blocks = {}  # devices holding the same block (replicas) share one read

        def block(index):
          ranges = tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape))
          if ranges not in blocks:
            blocks[ranges] = _leaf_block(read, tensor, ranges, stacked=_path(path)[0] in STACKS,
                                         vocab=cfg.vocab_size).astype(leaf.dtype)
          return blocks[ranges]

        return jax.make_array_from_callback(leaf.shape, sharding, block, dtype=leaf.dtype)

      return jax.tree_util.tree_map_with_path(place, abstract, layout.param_shardings)

  def _stored_name(self, name: str) -> str | None:
    # Checkpoints saved from the base model (the hub's gpt2) drop the `transformer.` / `model.` prefix.
    if name in self.shapes:
      return name
    bare = name.split(".", 1)[1]
    return bare if bare in self.shapes else None


def open_init_from(init_from: str) -> HFCheckpoint | None:
  """The checkpoint `config.init_from` names, or None for a random start."""
  if not init_from:
    return None
  if not init_from.startswith(SCHEME) or init_from == SCHEME:
    raise ValueError(f"init_from={init_from!r} is not understood; use hf:<directory> (a Hugging Face "
                     "checkpoint) or leave it empty for a random start.")
  return open_checkpoint(init_from[len(SCHEME):])


def open_checkpoint(path: str) -> HFCheckpoint:
  directory = Path(path).expanduser()
  config_file = directory / "config.json"
  if not config_file.is_file():
    raise ValueError(f"{directory} holds no config.json; give a directory written by transformers' "
                     "save_pretrained.")
  hf = _json_object(config_file)
  fields, tied = hf_mapping.model_fields(hf, str(config_file))
  files = _tensor_files(directory)
  if fields.get("mtp_depth") and not any(".eh_proj." in name for name in files):
    fields = {**fields, "mtp_depth": 0}  # config.json counts prediction modules its tensors lack
  shapes, quantized = {}, set()
  for file in sorted(set(files.values())):
    held = _stored_shapes(file)
    stray = next((name for name, f in files.items() if f == file and name not in held), None)
    if stray is not None:
      raise ValueError(f"{directory / WEIGHTS_INDEX} puts {stray} in {file}, which does not hold it; "
                       f"{RESAVE}.")
    shapes.update(held)
    quantized.update(name for name, dtype in fp8_weights.stored_dtypes(file).items() if dtype == fp8_weights.STORED)
  block = fp8_weights.block_size(hf, str(config_file))
  unscaled = sorted(name for name in quantized if name + fp8_weights.SCALE_SUFFIX not in shapes or
                    len(shapes[name]) != 2)
  if quantized and (block is None or unscaled):
    name = unscaled[0] if unscaled else min(quantized)
    raise ValueError(f"{directory} stores {name} as float8 without "
                     + ("a quantization_config in config.json" if block is None else
                        f"a matrix's block scales ({name}{fp8_weights.SCALE_SUFFIX})")
                     + "; meshlm reads block-scaled fp8 matrices as DeepSeek-V3 publishes them, or float weights.")
  # The positions it was trained to attend over, which evaluation takes as its length (interop/harness.py).
  context = hf.get("max_position_embeddings") or hf.get("n_positions") or 0
  return HFCheckpoint(directory, fields, tied, files, shapes, context, frozenset(quantized), block)


def _json_object(file: Path) -> dict:
  """The JSON object `file` holds, or a ValueError naming the file."""
  try:
    value = json.loads(file.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
    raise ValueError(f"{file} cannot be read as JSON ({error}); {RESAVE}.") from None
  if not isinstance(value, dict):
    raise ValueError(f"{file} holds a JSON {type(value).__name__}, not an object; {RESAVE}.")
  return value


def _stored_shapes(file: str) -> dict:
  """Tensor name -> shape, from a safetensors header that safetensors has checked against the file's size."""
  try:
    with safe_open(file, framework="np") as f:
      return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
  except (SafetensorError, OSError) as error:
    raise ValueError(f"{file} cannot be read as safetensors ({error}): it is truncated or damaged; download "
                     f"it again, or {RESAVE}.") from None


def _tensor_files(directory: Path) -> dict:
  """Tensor name -> the safetensors file holding it (one file, or several named by the index)."""
  index = directory / WEIGHTS_INDEX
  if index.is_file():
    weight_map = _json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
      given = "missing" if weight_map is None else f"a JSON {type(weight_map).__name__}"
      raise ValueError(f"{index}'s weight_map is {given}, not an object from tensor names to file names; "
                       f"{RESAVE}.")
    for name, file in weight_map.items():
      if not isinstance(file, str) or not file:
        raise ValueError(f"{index} gives {name} the file {file!r}, not a file name; {RESAVE}.")
      # An index is data from elsewhere, so its names are checked as written: links in the directory
      # are followed, as transformers does (the hub cache links each file to ../../blobs/<hash>).
      if Path(file).is_absolute() or ".." in Path(file).parts:
        raise ValueError(f"{index} names {file}, which lies outside {directory}; an index may only "
                         "name files in its own directory (relative names without '..').")
    absent = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
    if absent:
      raise ValueError(f"{index} names {absent[0]}, which is not in {directory}; download it again, or "
                       f"{RESAVE}.")
    return {name: str(directory / f) for name, f in weight_map.items()}
  weights = directory / WEIGHTS
  if not weights.is_file():
    raise ValueError(f"{directory} holds no {WEIGHTS} (pytorch_model.bin is not read: load it in "
                     "transformers and save_pretrained it again, which writes safetensors).")
  return dict.fromkeys(_stored_shapes(str(weights)), str(weights))


def _expected_shapes(cfg: ModelConfig, tied: bool) -> dict:
  shapes = {}
  for path, tensor in hf_mapping.tensors(cfg, tied).items():
    for index in indices(cfg, tensor, path):
      shapes[tensor.hf_name(**index)] = tensor.hf_shape
  return shapes


def indices(cfg: ModelConfig, tensor: hf_mapping.Tensor, path: tuple) -> list[dict]:
  """The {layer, expert} of each Hugging Face tensor the meshlm weight at `path` is made of, in its leading axes'
  order: a stack's units (the scanned one's, moe.first_dense's dense layers, the prediction modules)."""
  stack = {STACKED: cfg.num_units, DENSE_STACKED: cfg.moe_first_dense, MTP: cfg.mtp_depth}.get(path[0])
  layers = range(stack) if stack is not None else [None]
  experts = range(cfg.num_experts) if tensor.per_expert else [None]
  return [{"layer": layer, "expert": expert} for layer in layers for expert in experts]


def _path(key_path) -> tuple:
  return tuple(k.key for k in key_path)


def _leaf_block(read, tensor: hf_mapping.Tensor, ranges: tuple, *, stacked: bool, vocab: int) -> np.ndarray:
  """The block `ranges` ((start, stop) per meshlm axis) of one weight; a stacked weight reads layer by layer,
  and an expert's matrix expert by expert."""
  leading = ("layer",) * stacked + ("expert",) * tensor.per_expert

  def block(index: dict, ranges: tuple) -> np.ndarray:
    if len(index) == len(leading):
      return _layer_block(read, tensor.hf_name(**index), tensor, ranges, vocab)
    return np.stack([block({**index, leading[len(index)]: i}, ranges[1:]) for i in range(*ranges[0])])

  return block({}, ranges)


def _layer_block(read, name: str, tensor: hf_mapping.Tensor, ranges: tuple, vocab: int) -> np.ndarray:
  """Read the HF rows that cover one layer's block, then reshape, slice and transpose into meshlm's layout."""
  ranges, padding = list(ranges), 0
  if tensor.padded_axis is not None:  # rows past the real vocabulary are meshlm's zero padding
    start, stop = ranges[tensor.padded_axis]
    real_stop = max(start, min(stop, vocab))
    ranges[tensor.padded_axis], padding = (start, real_stop), stop - real_stop
  view_ranges = [None] * len(tensor.perm)
  for axis, view_axis in enumerate(tensor.perm):
    view_ranges[view_axis] = ranges[axis]
  shape = tuple(stop - start for start, stop in ranges)
  if 0 in shape:
    block = np.zeros(shape, np.float32)
  else:
    # An HF axis split into (a, b, ...) is read as the rows of its outermost part a that the
    # block needs, in full over b, ...; the inner parts are sliced once it is reshaped.
    hf_index, view_shape, inner, axis = [], [], [], 0
    for sizes in tensor.split:
      (start, stop), rest = view_ranges[axis], math.prod(sizes[1:])
      hf_index.append(slice(start * rest, stop * rest))
      view_shape += [stop - start, *sizes[1:]]
      inner += [slice(None)] + [slice(*r) for r in view_ranges[axis + 1:axis + len(sizes)]]
      axis += len(sizes)
    block = read(name, tuple(hf_index)).reshape(view_shape)[tuple(inner)].transpose(tensor.perm)
  if padding:
    widths = [(0, padding if axis == tensor.padded_axis else 0) for axis in range(block.ndim)]
    block = np.pad(block.astype(np.float32), widths)
  return block


def tied_head(cfg: ModelConfig, params: dict) -> bool:
  """Whether the params' head equals the token embedding (always for GPT-2, whose head is the embedding)."""
  if cfg.traits.tied_head:
    return True
  v = cfg.vocab_size
  return bool(np.array_equal(params["head"][:, :v], params["embed"][:v].T))


def check_new_directory(directory: str) -> Path:
  """`directory`, resolved, if it can be written and is new or empty: export never writes over anything."""
  target = Path(directory).expanduser().resolve()
  # The export is written beside the target, in the nearest folder that exists, then renamed onto it.
  folders = [target, target.parent] if target.is_dir() else [next(p for p in target.parents if p.exists())]
  unwritable = next((f for f in folders if cannot_hold_files(f)), None)
  if unwritable is not None:
    raise ValueError(f"{target} cannot be written ({unwritable} is not writable); export to a folder you "
                     "can write in.")
  if target.exists() and (not target.is_dir() or any(target.iterdir())):
    raise ValueError(f"{target} already exists and is not an empty directory; export writes a new one.")
  return target


EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def write(directory: str, cfg: ModelConfig, params: dict, beside: tuple[Path, ...] = (),
          dtype: str = "float32") -> Path:
  """Write host `params` (meshlm's layout) as a Hugging Face directory; nothing is left behind on failure.

  Weights are stored in `dtype` (EXPORT_DTYPES). Files `beside` (a tokenizer's) are copied in with them.
  """
  if dtype not in EXPORT_DTYPES:
    raise ValueError(f"--dtype={dtype} cannot be exported; use one of {', '.join(EXPORT_DTYPES)}.")
  target = check_new_directory(directory)
  tied = tied_head(cfg, params)
  hf = {}
  for path, tensor in hf_mapping.tensors(cfg, tied).items():
    leaf = params
    for key in path:
      leaf = leaf[key]
    for name, array in hf_pieces(cfg, tensor, path, leaf):
      hf.setdefault(name, array.astype(EXPORT_DTYPES[dtype]))
  return write_directory(target, hf, {"config.json": hf_mapping.hf_config(cfg, tied, dtype)}, beside)


def hf_pieces(cfg: ModelConfig, tensor: hf_mapping.Tensor, path: tuple, leaf):
  """(name, float32 array as Hugging Face lays it out) of each tensor the meshlm weight `leaf` at `path` makes."""
  for index in indices(cfg, tensor, path):
    array = leaf
    for i in (i for i in index.values() if i is not None):
      array = array[i]
    yield tensor.hf_name(**index), to_hf(tensor, np.asarray(array, np.float32))


def write_directory(target: Path, tensors: dict, configs: dict, beside: tuple[Path, ...] = (),
                    weights: str = WEIGHTS) -> Path:
  """`tensors` as the safetensors file `weights`, each of `configs` ({file name: a JSON object}) and copies of
  the files `beside`, written into `target` (check_new_directory's) all at once or not at all."""
  needed = sum(array.nbytes for array in tensors.values()) + sum(path.stat().st_size for path in beside)
  made = [p for p in target.parents if not p.exists()]  # folders made for the export, innermost first
  try:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
      save_file(tensors, str(partial / weights), metadata={"format": "pt"})  # transformers wants the format
      for name, config in configs.items():
        (partial / name).write_text(json.dumps(config, indent=2) + "\n")
      for path in beside:
        shutil.copyfile(path, partial / path.name)
      os.chmod(partial / weights, 0o644)  # save_file creates it private, mkdtemp its directory
      os.chmod(partial, 0o755)
      partial.rename(target)  # over an empty directory too, so a reader never sees half a checkpoint
    finally:
      shutil.rmtree(partial, ignore_errors=True)
  except (OSError, SafetensorError) as error:
    # A full disk (safetensors' writer reports it in an error of its own, not an OSError, with the OS's words),
    # or permissions that changed since check_new_directory.
    for folder in made:
      with contextlib.suppress(OSError):
        folder.rmdir()
    space = ""
    if os.strerror(errno.ENOSPC) in str(error):
      free = shutil.disk_usage(next(p for p in target.parents if p.exists())).free
      space = f"; the export needs {needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free"
    raise ValueError(f"writing {target} failed ({error}), so nothing was written{space}: make room or export "
                     "to another folder.") from None
  return target


def to_hf(tensor: hf_mapping.Tensor, array: np.ndarray) -> np.ndarray:
  """One layer's meshlm array as the HF tensor: drop vocabulary padding, undo the transpose and the split."""
  if tensor.padded_axis is not None:
    real = [size for sizes in tensor.split for size in sizes][tensor.perm[tensor.padded_axis]]
    array = np.take(array, np.arange(real), axis=tensor.padded_axis)
  return np.ascontiguousarray(array.transpose(np.argsort(tensor.perm)).reshape(tensor.hf_shape))
