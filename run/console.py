"""The run's console: one line at a time from process 0, above the progress bar, and a log step's line."""

import jax
from tqdm import tqdm

from model import mtp


def log(line: str) -> None:
  if jax.process_index() == 0:  # one console per run, however many hosts
    tqdm.write(line)  # above the progress bar, which stays at the bottom


def optional_figures(fetched: dict) -> dict:
  """float16's loss scale, the multi-token prediction modules' cross-entropy, a MoE model's router statistics, a
  preference objective's rewards and GRPO's rollout figures as scalars; each expert's share of the choices gets
  its own key."""
  figures = {key: float(value) for key, value in fetched.items()
             if key.startswith(("moe_", "dpo_", "grpo_")) or key in ("loss_scale", mtp.LOSS)}
  if "expert_load" in fetched:
    figures.update({f"expert_load/{i}": float(share) for i, share in enumerate(fetched["expert_load"])})
  return figures


def step_line(m: dict) -> str:
  """A log step's figures (the loop's `last`) in one line."""
  mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
  skipped = f"  skipped {m['skipped']}" if m["skipped"] else ""
  scale = f"  loss_scale {m['loss_scale']:.0f}" if "loss_scale" in m else ""
  ahead = f"  mtp {m[mtp.LOSS]:.4f}" if mtp.LOSS in m else ""
  line = (f"step {m['step']:6d}  loss {m['loss']:.4f}{ahead}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
          f"tokens/s {m['tokens_per_sec']:,.0f}  mfu {mfu}{skipped}{scale}")
  if "dpo_accuracy" in m:
    line += f"  reward accuracy {m['dpo_accuracy']:.2f}  margin {m['dpo_margin']:.3f}"
  if "grpo_reward" in m:
    line += f"  reward {m['grpo_reward']:.3f}  completion length {m['grpo_completion_length']:.1f}"
  if "moe_balance_loss" in m:
    loads = [value for key, value in m.items() if key.startswith("expert_load/")]
    line += (f"  balance {m['moe_balance_loss']:.3f}  z {m['moe_z_loss']:.2f}  dropped {m['moe_dropped']:.1%}"
             f"  expert load {min(loads):.3f}..{max(loads):.3f}")
  return line
