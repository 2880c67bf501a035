"""LoRA adapters written as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors), which
`peft.PeftModel.from_pretrained` loads onto the Hugging Face model the run started from.

meshlm's factors lie along its own axes (training/lora.py), which Hugging Face's layout reshapes and transposes
(interop/hf_mapping.py). Each adapted kernel's update, scale x A B, is laid out as Hugging Face holds the kernel
(the same mapping an export uses), then factored again: its rank is at most lora.rank, so the truncated singular
value decomposition U S V^T gives PEFT's lora_B = U sqrt(S) and lora_A = sqrt(S) V^T (each over sqrt(scale)) whose
product is the update to float32's rounding. GPT-2 stores its projections (in, out) as Conv1D does: PEFT's
fan_in_fan_out.
"""

import jax
import numpy as np

from interop import hf_checkpoint, hf_mapping
from model.config import ModelConfig
from training import lora

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_tensors(cfg: ModelConfig, settings: lora.Lora, params: dict, adapters: dict) -> dict:
  """{PEFT tensor name: float32 array} for host `adapters` of `params`' kernels."""
  table = hf_mapping.tensors(cfg, hf_checkpoint.tied_head(cfg, params))
  updates = jax.device_get(jax.tree.map(jax.numpy.subtract, lora.merged(settings, params, adapters), params))
  out = {}
  for path, pair in _pairs(adapters):
    tensor = table[path]
    if tensor.per_expert:
      raise ValueError(f"the adapters of {'/'.join(map(str, path))} adapt experts, which transformers keeps fused "
                       "and PEFT's LoRA layers do not wrap; export the merged weights instead (without --adapter).")
    leaf = updates
    for key in path:
      leaf = leaf[key]
    for name, update in hf_checkpoint.hf_pieces(cfg, tensor, path, leaf):
      out_in = update.T if cfg.family == "gpt2" else update  # Conv1D: (in, out)
      u, s, vt = np.linalg.svd(out_in.astype(np.float64), full_matrices=False)
      root = np.sqrt(s[:settings.rank] / settings.scale)
      module = "base_model.model." + name.removesuffix(".weight")
      out[f"{module}.lora_A.weight"] = (root[:, None] * vt[:settings.rank]).astype(np.float32)
      out[f"{module}.lora_B.weight"] = (u[:, :settings.rank] * root).astype(np.float32)
  return out


def _pairs(adapters: dict, path: tuple = ()):
  """(kernel's path, {A, B}) of each adapted kernel."""
  if lora.A in adapters:
    yield path, adapters
    return
  for key, child in adapters.items():
    yield from _pairs(child, (*path, key))


def config(cfg: ModelConfig, settings: lora.Lora, tensors: dict, base: str | None) -> dict:
  """adapter_config.json: PEFT's LoRA with the exact modules adapted."""
  modules = sorted({name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for name in tensors})
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
          "target_modules": modules, "fan_in_fan_out": cfg.family == "gpt2", "lora_dropout": 0.0, "bias": "none",
          "inference_mode": True, "base_model_name_or_path": base}
