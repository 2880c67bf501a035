"""docs/planning.md's planning tables, one command: the planner's own runs, and the planner beside
published runs (Megatron-LM's weak-scaling table, Llama 3 70B on TPU v5p) and measured ones (the
committed bench records, benchmarks/).

  python tools/planning_tables.py            # prints every table
  python tools/planning_tables.py --rows=1.7b,145.6b --blocks=megatron
  python tools/planning_tables.py --write    # and rewrites docs/planning.md's <!-- planning:... --> blocks

speed, verify and tiers are the planning page's commands run as written (each a
subprocess: a command that simulates devices fixes their count when jax starts),
their tables cut from what they print. megatron, llama and calibration are
measure/planning_tables.py's: the planner beside published runs; check is every committed
benchmarks/*/*.jsonl record predicted beside what it measured (`tools/plan.py --check`).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

from configs import megatron
from measure.doc_blocks import replace_block
from measure.planning_tables import calibration_table, check_records, check_table, llama_table, megatron_table

ROOT = Path(__file__).resolve().parent.parent

_ROWS = flags.DEFINE_list("rows", list(megatron.ROWS), f"Megatron-LM rows, of {', '.join(megatron.ROWS)}.")
_BLOCKS = flags.DEFINE_list("blocks", ["speed", "verify", "tiers", "calibration", "check", "megatron", "llama"],
                            "The tables to make.")
_WRITE = flags.DEFINE_bool("write", False, "Rewrite the <!-- planning:... --> blocks of --page.")
_PAGE = flags.DEFINE_string("page", str(ROOT / "docs" / "planning.md"), "The file --write rewrites.")

# The planning page's commands whose output it shows: (the command, what to keep of its output).
SPEED = ["tools/plan.py", "--config=configs/llama.py:405b", "--kind=h100", "--devices=16384", "--global_batch=2048",
         "--seq_len=8192", "--top=3"]
VERIFY = ["tools/plan.py", "--kind=h100", "--devices=8", "--fast_group=4", "--global_batch=16",
          "--config.model.num_layers=4", "--top=3", "--verify=2"]
TIERS = ["train.py", "--config=configs/gpt2.py:tiny", "--dry_run", "--simulate_devices=8", "--config.mesh.data=4",
         "--config.mesh.tensor=2", "--config.mesh.dcn_data=2"]


def command_output(argv: list[str], simulated: int = 0) -> str:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={simulated}") if simulated else None
  result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env, check=True)
  return result.stdout


def table_lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.startswith("|")]


def speed_block() -> str:
  out = command_output(SPEED)
  searched = next(line for line in out.splitlines() if "layouts scored in" in line)
  ranked = table_lines(out)
  return "\n".join([f"{searched.rstrip('.')}, on {machine()}.", "", *ranked])


def machine() -> str:
  """This machine's cores and processor, for the time the search took."""
  with open("/proc/cpuinfo") as cpuinfo:
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "a CPU")
  return f"{os.cpu_count()} cores of an {model}"


def verify_block() -> str:
  tables = table_lines(command_output(VERIFY, simulated=8))
  return "\n".join(tables[:5] + [""] + tables[5:])


def tiers_block() -> str:
  lines = command_output(TIERS).splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("per device, by network tier"))
  end = next(i for i in range(start, len(lines)) if lines[i].startswith("collectives: total"))
  return "\n".join(["```", *lines[start:end + 1], "```"])


def main(argv):
  del argv
  unknown = [r for r in _ROWS.value if r not in megatron.ROWS]
  if unknown:
    sys.exit(f"error: unknown rows {unknown}; give some of {', '.join(megatron.ROWS)}.")
  makers = {"speed": speed_block, "verify": verify_block, "tiers": tiers_block, "calibration": calibration_table,
            "megatron": lambda: megatron_table(_ROWS.value), "llama": llama_table,
            "check": lambda: check_table(check_records([str(p) for p in sorted(ROOT.glob("benchmarks/*/*.jsonl"))]))}
  blocks = {}
  for name in _BLOCKS.value:
    started = time.time()
    blocks[name] = makers[name]()
    print(f"{name} ({time.time() - started:.0f} s):\n{blocks[name]}\n")
  if _WRITE.value:
    page = Path(_PAGE.value)
    text = page.read_text()
    for name, block in blocks.items():
      text = replace_block(text, f"planning:{name}", block + "\n\nMade by `python tools/planning_tables.py --write`.\n")
    page.write_text(text)


if __name__ == "__main__":
  app.run(main)
