"""Block-scaled float8 weights, as DeepSeek-V3's published checkpoint stores its projections, read as float32.

Such a checkpoint's config.json has `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128]}: each quantized matrix W (out x in) is stored as float8 e4m3 beside
`<name>_scale_inv`, one float32 per 128 x 128 block, and W = stored x scale_inv block by block (DeepSeek-V3's
own `weight_dequant`). The safetensors library reads float8 into torch only, so the bytes are read here
straight from the file, whose header says where each tensor lies.
"""

import json
import struct

import ml_dtypes
import numpy as np

STORED = "F8_E4M3"  # safetensors' name for float8 e4m3
SCALE_SUFFIX = "_scale_inv"
_HEADER_LENGTH = struct.Struct("<Q")  # a safetensors file opens with its JSON header's length, 8 bytes little-endian


def block_size(hf: dict, where: str) -> tuple[int, int] | None:
  """The (rows, columns) of one scale's block from config.json's quantization_config; None without one."""
  quantization = hf.get("quantization_config")
  if not quantization:
    return None
  method, fmt = quantization.get("quant_method"), quantization.get("fmt", "e4m3")
  block = quantization.get("weight_block_size") or [128, 128]
  if method != "fp8" or fmt != "e4m3" or len(block) != 2:
    raise ValueError(f"{where} is quantized as {method} ({fmt}, blocks {block}); meshlm reads block-scaled fp8 e4m3 "
                     "weights (DeepSeek-V3's) only: dequantize it in transformers and save_pretrained it again.")
  return tuple(block)


def stored_dtypes(file: str) -> dict:
  """Tensor name -> its safetensors dtype string, from the file's header."""
  return {name: entry["dtype"] for name, entry in _header(file)[0].items() if name != "__metadata__"}


def read(file: str, name: str, scale_inv: np.ndarray, index: tuple, block: tuple) -> np.ndarray:
  """Rows and columns `index` (two slices) of the float8 matrix `name` in float32: each entry times its block's
  scale."""
  header, start = _header(file)
  entry = header[name]
  begin, end = entry["data_offsets"]
  rows, cols = entry["shape"]
  stored = np.memmap(file, np.uint8, "r", start + begin, (end - begin,)).view(ml_dtypes.float8_e4m3fn)
  values = stored.reshape(rows, cols)[index].astype(np.float32)
  row_blocks = np.arange(*index[0].indices(rows)[:2]) // block[0]
  col_blocks = np.arange(*index[1].indices(cols)[:2]) // block[1]
  return values * scale_inv[np.ix_(row_blocks, col_blocks)]


def _header(file: str) -> tuple[dict, int]:
  """(the header's entries, where the data begins)."""
  with open(file, "rb") as f:
    (length,) = _HEADER_LENGTH.unpack(f.read(_HEADER_LENGTH.size))
    return json.loads(f.read(length)), _HEADER_LENGTH.size + length
