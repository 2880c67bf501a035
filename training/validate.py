"""Run-level settings checked in one place, before anything is compiled or written.

The model's shape and the mesh are checked by plan() (model/config.py, parallel/checks.py); this
module covers what only the training run uses. Each bad value gets one sentence naming the field,
the value and what would work.
"""

import importlib.util
import math
import os
import tempfile
from pathlib import Path

from training import curriculum, grpo, lora, preference, rewards


NONFINITE_POLICIES = ("skip", "stop")
NONFINITE_CHECKS = ("scalars", "full")
FAULT_TOLERANCE = ("none", "survive")


def _at_least(config, field: str, low: int, why: str = "") -> None:
  value = _get(config, field)
  if not isinstance(value, int) or value < low:
    raise ValueError(f"{field}={value!r} must be an integer of at least {low}{why}.")


MAX_LR = 1e30


def _finite_non_negative(config, field: str, what: str, *, zero: bool = True) -> None:
  """A finite number >= 0, or > 0 where `zero` is not allowed."""
  value = _get(config, field)
  if not (isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if zero else value > 0)):
    raise ValueError(f"{field}={value!r} must be a finite number {'>=' if zero else '>'} 0 ({what}).")


def _in_range(config, field: str, low: float, high: float, *, closed: bool, what: str) -> None:
  """`low <= value < high` (`<= high` when closed): a decay rate, a ratio."""
  value = _get(config, field)
  if not (isinstance(value, (int, float)) and low <= value and (value <= high if closed else value < high)):
    raise ValueError(f"{field}={value!r} must be in [{low}, {high}{']' if closed else ')'} ({what}).")


def _get(config, field: str):
  node = config
  for key in field.split("."):
    node = node[key]
  return node


def check_run(config) -> None:
  """Refuses the first bad run setting in one sentence."""
  _at_least(config, "steps", 1)
  _at_least(config, "batch_size", 1)
  _at_least(config, "grad_accum", 1)
  _at_least(config, "log_every", 1)
  curriculum.check(config)
  _at_least(config, "eval_every", 0, " (0 turns evaluation off)")
  if config.eval_every:
    _at_least(config, "eval_batches", 1, " while eval_every is on")
  _at_least(config, "sample_tokens", 0, " (0 skips the closing sample)")
  _at_least(config, "data.prefetch", 0, " (0 builds each batch when it is needed)")
  _at_least(config, "checkpoint.every", 0, " (0 saves only the last step)")
  _at_least(config, "checkpoint.keep", 1, ": the newest k checkpoints are kept, and 0 would delete them all")
  if config.wandb.project and importlib.util.find_spec("wandb") is None:
    raise ValueError(f"wandb.project={config.wandb.project!r} needs the wandb package: pip install -e '.[wandb]' "
                     "(or leave wandb.project empty; TensorBoard and metrics.jsonl are always written).")
  for field in ("model.num_layers", "model.num_heads", "model.vocab_size", "model.max_len",
                "model.embed_dim", "model.mlp_dim"):
    _at_least(config, field, 1)
  _finite_non_negative(config, "optimizer.lr", "the peak learning rate")
  # Near float32's largest value one update can overflow the weights while the loss, the gradient norm
  # and the rate stay finite, which the default nonfinite_check=scalars would not see.
  if config.optimizer.lr > MAX_LR:
    raise ValueError(f"optimizer.lr={config.optimizer.lr!r} is beyond any learning rate that trains (at most "
                     f"{MAX_LR:g}); give the peak learning rate, e.g. 3e-4.")
  _finite_non_negative(config, "optimizer.clip_norm", "0 turns clipping off")
  _finite_non_negative(config, "optimizer.weight_decay", "0 turns decay off")
  # Checked whichever optimizer runs. A decay rate of 1 or more never forgets (b2=1 divides by zero
  # at the first step); a negative one flips the sign of what it keeps.
  _in_range(config, "optimizer.b1", 0, 1, closed=False, what="the gradient mean's decay per step; 0.9 is usual")
  _in_range(config, "optimizer.b2", 0, 1, closed=False,
            what="the squared gradient's decay per step; 0.95 or 0.999 is usual")
  _in_range(config, "optimizer.momentum", 0, 1, closed=False, what="the velocity's decay per step; 0.9 is usual")
  _finite_non_negative(config, "optimizer.eps", "Adam's floor under the root of v; 1e-8 is usual", zero=False)
  _in_range(config, "optimizer.muon_momentum", 0, 1, closed=False, what="Muon's momentum decay per step; 0.95 is usual")
  _at_least(config, "optimizer.muon_steps", 1, ": Newton-Schulz iterations, 5 is usual")
  _finite_non_negative(config, "optimizer.muon_rms", "the RMS Muon's updates are scaled to; 0.2 matches AdamW's",
                       zero=False)
  _at_least(config, "schedule.warmup_steps", 0, " (0 starts at the peak learning rate)")
  _in_range(config, "schedule.final_lr_ratio", 0, 1, closed=True,
            what="the last step's learning rate over the peak; 0.1 is usual")
  _finite_non_negative(config, "peak_tflops", "per device, for MFU; 0 looks the device kind up")
  _finite_non_negative(config, "precision.loss_scale", "float16's starting loss scale; 2**15 is usual",
                       zero=False)
  _at_least(config, "precision.loss_scale_growth", 1, ": finite steps in a row before the loss scale doubles")
  _at_least(config, "pipeline.microbatches", 1)
  _at_least(config, "pipeline.virtual_stages", 1, ": layer chunks per device under the interleaved schedule")
  if (config.pipeline.first_stage_layers and config.mesh.pipeline > 1 and config.optimizer.name == "muon"
      and config.optimizer.muon_iteration == "gathered"):
    raise ValueError("optimizer.muon_iteration=gathered gathers each matrix split over pipeline by layer, which "
                     "unequal stages (pipeline.first_stage_layers) cannot; use round_robin or partitioned.")
  if config.moe.bias_rate and config.optimizer.name == "schedule_free_adamw":
    raise ValueError(f"moe.bias_rate={config.moe.bias_rate} moves each layer's router bias by its loads after the "
                     "optimizer's update, which schedule-free's averaged weights do not carry; balance by "
                     "moe.balance_weight with it, or use another optimizer.")
  _check_preference(config)
  _check_lora(config)
  if config.fault_tolerance not in FAULT_TOLERANCE:
    raise ValueError(f"fault_tolerance={config.fault_tolerance!r} is unknown; use {' or '.join(FAULT_TOLERANCE)}.")
  _at_least(config, "distributed.heartbeat_seconds", 1)
  _at_least(config, "peer_copy_every", 0, ": steps between peer copies (0: none)")
  if config.peer_copy_every and config.fault_tolerance != "survive":
    raise ValueError(f"peer_copy_every={config.peer_copy_every} keeps copies for a run that survives a lost "
                     "process; add --config.fault_tolerance=survive, or leave peer_copy_every at 0.")
  if config.nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f"nonfinite={config.nonfinite!r} is unknown; use {' or '.join(NONFINITE_POLICIES)}.")
  if config.nonfinite_check not in NONFINITE_CHECKS:
    raise ValueError(f"nonfinite_check={config.nonfinite_check!r} is unknown; use {' or '.join(NONFINITE_CHECKS)}.")
  _check_workdir(config.workdir)


def _check_preference(config) -> None:
  """Refuses a preference or reinforcement objective the run cannot train (training/preference.py,
  training/grpo.py)."""
  if config.objective not in preference.OBJECTIVES:
    raise ValueError(f"objective={config.objective!r} is unknown; use {' or '.join(preference.OBJECTIVES)}.")
  if config.objective == "lm":
    return
  if config.objective == "dpo":
    _check_dpo(config)
  else:
    _check_grpo(config)
  for field, value, why in (("mesh.pipeline", config.mesh.pipeline > 1, "a pipeline's last stage scores next "
                             "tokens, not whole answers; use mesh.pipeline=1"),
                            ("model.mtp_depth", config.model.mtp_depth, "prediction modules train next tokens "
                             "only; set model.mtp_depth=0"),
                            ("branch_from", config.branch_from, "a branch carries another objective's optimizer "
                             "state and step; export that run (tools/export.py) and start from it with "
                             "--config.init_from=hf:DIR"),
                            ("fault_tolerance", config.fault_tolerance == "survive", "survive mode steps on "
                             "language-model batches; use fault_tolerance=none")):
    if value:
      raise ValueError(f"objective={config.objective} with {field}={_get(config, field)!r}: {why}.")


def _check_dpo(config) -> None:
  if config.dpo.loss not in preference.LOSSES:
    raise ValueError(f"dpo.loss={config.dpo.loss!r} is unknown; use one of {', '.join(preference.LOSSES)}.")
  _finite_non_negative(config, "dpo.beta", "the log-ratio's scale; 0.1 is usual", zero=False)
  _in_range(config, "dpo.label_smoothing", 0, 0.5, closed=False,
            what="the assumed rate of flipped preferences, below 0.5; 0 trusts every label")
  _finite_non_negative(config, "dpo.sft_weight", "the chosen answers' log-likelihood's weight; 0 leaves it out")
  if config.dpo.label_smoothing and config.dpo.loss != "robust":
    raise ValueError(f"dpo.label_smoothing={config.dpo.label_smoothing} acts on the robust loss only; add "
                     "--config.dpo.loss=robust, or leave label_smoothing at 0.")
  if config.data.source != "tokens":
    raise ValueError(f"objective=dpo trains on preference pairs, which data.source={config.data.source!r} does not "
                     "hold; prepare them with tools/prepare.py --chosen_field=... --rejected_field=... and give "
                     "--config.data.source=tokens --config.data.path=DIR.")


def _check_grpo(config) -> None:
  g = config.grpo
  if not g.prompts:
    raise ValueError("objective=grpo samples completions of prompts, and grpo.prompts names none; give "
                     "--config.grpo.prompts=FILE.jsonl, records with a prompt and its answer.")
  _at_least(config, "grpo.group", 2, ": completions per prompt, whose rewards are compared with each other")
  if config.batch_size % g.group:
    raise ValueError(f"batch_size={config.batch_size} is not a multiple of grpo.group={g.group}: a batch holds "
                     "whole groups of one prompt's completions; make batch_size a multiple of it.")
  _at_least(config, "grpo.max_new_tokens", 1)
  _finite_non_negative(config, "grpo.temperature", "the sampling temperature the rollouts and the loss share",
                       zero=False)
  _in_range(config, "grpo.top_p", 0, 1, closed=True, what="the nucleus' probability; 1 keeps every token")
  if not g.top_p:
    raise ValueError("grpo.top_p=0 keeps no token; use a value in (0, 1].")
  _at_least(config, "grpo.top_k", 0, " (0 keeps the whole vocabulary)")
  _finite_non_negative(config, "grpo.beta", "the KL divergence's weight; 0 leaves the reference out")
  for field, allowed in (("grpo.loss", grpo.LOSSES), ("grpo.scale_rewards", grpo.SCALES)):
    if _get(config, field) not in allowed:
      raise ValueError(f"{field}={_get(config, field)!r} is unknown; use one of {', '.join(allowed)}.")
  if config.eval_every and not g.eval_prompts:
    raise ValueError(f"eval_every={config.eval_every} under objective=grpo scores greedy answers to "
                     "grpo.eval_prompts, which names no file; give one, or set --config.eval_every=0.")
  if config.data.source == "tokens":
    raise ValueError("objective=grpo samples its batches for grpo.prompts and reads no token data; leave "
                     "data.source at its default.")
  rewards.reward(g.reward)  # an unknown or unimportable reward, refused in one sentence


def _check_lora(config) -> None:
  """Refuses LoRA settings the run cannot train (training/lora.py)."""
  _at_least(config, "lora.rank", 0, " (0 trains every weight)")
  if not config.lora.rank:
    if config.lora.frozen_dtype != "float32":
      raise ValueError(f"lora.frozen_dtype={config.lora.frozen_dtype!r} with lora.rank=0 freezes nothing; give "
                       "lora.rank > 0 to train adapters on a frozen base, or leave frozen_dtype at float32.")
    return
  _finite_non_negative(config, "lora.alpha", "the adapters' product is scaled by alpha / rank; 16 is usual",
                       zero=False)
  lora.settings(config)  # refuses unknown targets
  for field, value, why in (("mesh.pipeline", config.mesh.pipeline > 1, "a pipeline's stages hold the stacked "
                             "weights the adapters merge into; use mesh.pipeline=1"),
                            ("moe.bias_rate", config.moe.bias_rate, "the router biases are frozen with the other "
                             "weights; set moe.bias_rate=0"),
                            ("fault_tolerance", config.fault_tolerance == "survive", "survive mode lays out the "
                             "parameters alone; use fault_tolerance=none")):
    if value:
      raise ValueError(f"lora.rank={config.lora.rank} with {field}={_get(config, field)!r}: {why}.")


def _check_workdir(workdir: str) -> None:
  if not workdir.strip():
    raise ValueError("workdir is empty; give --config.workdir=DIR, a folder for checkpoints and logs.")
  path = Path(workdir).expanduser()
  if path.exists() and not path.is_dir():
    raise ValueError(f"workdir={workdir!r} is a file, not a folder; choose another --config.workdir.")
  existing = next(p for p in (path, *path.parents) if p.exists())  # the folder it will be made in
  reason = cannot_hold_files(existing)
  if reason:
    raise ValueError(f"workdir={workdir!r} cannot be written ({existing} cannot hold new files: "
                     f"{reason}); choose another --config.workdir.")


def cannot_hold_files(folder: Path) -> str | None:
  """Why no file can be made in `folder`, in the system's words, or None when one can.

  Making (and removing) a folder there is the only sure test: permission bits say nothing to root,
  and some filesystems (/proc, /sys, a read-only mount) refuse every new file whatever they say.
  """
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".meshlm-probe-", dir=folder))
  except OSError as error:
    return error.strerror
  return None
