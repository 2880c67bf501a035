"""What a GPT-2 layer keeps for its backward pass: meshlm's block beside torch.compile's, row by row, in D-units.

  python tools/saved_vs_torch.py --config=configs/gpt2.py:124m           # print the table
  python tools/saved_vs_torch.py --config=configs/gpt2.py:124m --write   # and rewrite BENCHMARKS.md's block

meshlm's side is measure/saved_for_backward.py on one sequence of model.max_len
tokens, with model.attention=auto resolved as on a GPU (cuDNN, counted by
rule). torch's side runs in the transformers sidecar (.venv-hf): transformers'
GPT2Block at the same width, heads, MLP width and length, with SDPA attention;
in a bfloat16 run its weights stay float32 under bfloat16 autocast, the
torch.compile peer's recipe (BENCHMARKS.md). It is compiled by torch.compile
through inductor's decompositions and partitioner (its joint-graph passes,
then the min-cut partition) with the code generation left out: the saved
tensors are the backward graph's inputs that are not gradients, less those
that do not depend on the block's input (the weights and their casts). On a
CPU SDPA is the flash kernel, which keeps q, k, v, its output and the
log-sum-exp, as on a GPU.
"""

import itertools
import json
import operator
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / ".venv-hf" / "bin" / "python"
PAGE = ROOT / "BENCHMARKS.md"
BLOCK = "saved-for-backward"
TORCH_SIDE = "--torch_side"  # how this file is run in the sidecar, which has torch but neither jax nor absl
TORCH_DTYPES = ("bfloat16", "float32")
SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16"}  # as jax writes them, for the table's two sides
CODE_WIDTH = 60  # characters of the transformers line shown for each tensor


def torch_saved(width: int, heads: int, mlp: int, length: int, epsilon: float, dtype: str) -> dict:
  """(In the sidecar) the tensors torch.compile's partitioner saves for the backward pass of one GPT2Block on
  one sequence: rows of {source, type, bytes per token, count}, in the forward pass's order."""
  import torch  # here, not above: only the sidecar has torch
  import transformers
  from torch._dynamo.backends.common import aot_autograd
  from torch._functorch.aot_autograd import make_boxed_func
  from torch._inductor import compile_fx
  from torch._inductor.decomposition import select_decomp_table

  torch.set_num_threads(1)  # the tests run beside XLA on a small machine
  config = transformers.GPT2Config(n_embd=width, n_head=heads, n_inner=mlp, n_positions=length,
                                   layer_norm_epsilon=epsilon, attn_implementation="sdpa")
  block = transformers.models.gpt2.modeling_gpt2.GPT2Block(config, layer_idx=0).eval()  # eval: no dropout
  x = torch.randn(1, length, width, requires_grad=True)
  graphs = {}

  def keep(name):
    def compiler(graph, _):
      graphs[name] = graph
      return make_boxed_func(graph)  # run as traced: nothing is generated
    return compiler

  partitioned = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                             decompositions=select_decomp_table(), partition_fn=compile_fx.partition_fn,
                             keep_inference_input_mutations=True)

  def backend(graph, inputs):
    graphs["x"] = next(i for i, t in enumerate(inputs) if t is x)  # the weights are the other inputs
    return partitioned(graph, inputs)

  with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
    out = torch.compile(block, backend=backend, fullgraph=True)(x)
  (out[0] if isinstance(out, tuple) else out).float().sum().backward()
  forward = list(graphs["forward"].graph.nodes)
  depends = {[n for n in forward if n.op == "placeholder"][graphs["x"]]}
  for node in forward:
    if node in depends or any(n in depends for n in node.all_input_nodes):
      depends.add(node)
  saved = {n.name for n in graphs["backward"].graph.nodes
           if n.op == "placeholder" and not n.name.startswith("tangents")}  # named as in the forward graph
  rows = {}
  for node in (n for n in forward if n.name in saved and n in depends):
    value = node.meta["val"]
    kind = str(value.dtype).removeprefix("torch.")
    key = (_torch_source(node), f"{SHORT_DTYPES.get(kind, kind)}[{','.join(map(str, value.shape))}]")
    rows.setdefault(key, {"source": key[0], "type": key[1], "bytes": value.numel() * value.element_size() / length,
                          "count": 0})["count"] += 1
  return {"rows": list(rows.values()), "torch": torch.__version__, "transformers": transformers.__version__}


def _torch_source(node) -> str:
  """A saved tensor's module (as the block names it), its aten operation and the transformers line that made it."""
  if node.op == "placeholder":
    return "the block's input"
  modules = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
  module = list(modules.values())[-1][0].removeprefix("L['self']").lstrip(".") if modules else ""
  picked = node.target is operator.getitem  # one output of a multi-output operation
  op = str(node.meta.get("original_aten") if picked else node.target).removeprefix("aten.").removesuffix(".default")
  trace = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
  code = next((line for line in reversed(trace) if line and not line.startswith(("File", "^", "~"))), "")
  code = code if len(code) <= CODE_WIDTH else code[:CODE_WIDTH - 3] + "..."
  moved = ", moved from the backward pass" if "autograd_backward" in node.meta else ""
  index = f"[{node.args[1]}]" if picked else ""
  return f"{module} {op}{index}{moved}: {code}".strip()


def meshlm_vs_torch(config):
  """(meshlm's Budget, torch's record) for one layer of the config's GPT-2 on one sequence."""
  from measure import saved_for_backward  # here, not above: the sidecar has no jax
  from training.state import model_config
  cfg = model_config(config)
  budget = saved_for_backward.budget(cfg, backend="gpu")
  job = dict(width=cfg.embed_dim, heads=cfg.num_heads, mlp=cfg.mlp_dim, length=cfg.max_len, epsilon=cfg.epsilon,
             dtype=cfg.compute_dtype)
  result = subprocess.run([str(SIDECAR), __file__, TORCH_SIDE, json.dumps(job)], capture_output=True, text=True,
                          timeout=600)
  if result.returncode:
    sys.exit(f"error: the torch side failed in the sidecar: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
  return budget, json.loads(result.stdout.strip().splitlines()[-1])


def table(budget, torch_record: dict) -> str:
  """Markdown: meshlm's kept values beside torch's saved tensors, each in forward order, with totals."""
  unit = budget.d_unit
  mine = [(f"{s.count} x " * (s.count > 1) + f"`{s.type}` {s.source}", budget.units(s.total))
          for s in budget.saved if not s.host]
  theirs = [(f"{r['count']} x " * (r["count"] > 1) + f"`{r['type']}` {r['source']}", r["bytes"] * r["count"] / unit)
            for r in torch_record["rows"]]
  cell = lambda row: (row[0].replace("|", "\\|"), f"{row[1]:.2f}") if row else ("", "")
  lines = ["| meshlm: kept by jax.vjp | D-units | torch.compile: saved by the partitioner | D-units |",
           "| --- | ---: | --- | ---: |"]
  lines += ["| {} | {} | {} | {} |".format(*cell(a), *cell(b)) for a, b in itertools.zip_longest(mine, theirs)]
  lines.append(f"| **total per token per layer** | **{budget.units(budget.per_layer):.2f}** | **total** | "
               f"**{sum(r[1] for r in theirs):.2f}** |")
  return "\n".join(lines)


def commit() -> str:
  """HEAD's short hash, and whether the code measured differs from it (any tracked file but the pages)."""
  git = lambda *args: subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  dirty = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
           if not line.endswith(".md")]
  return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes to the code measured" if dirty else "")


def main(argv):
  del argv
  from absl import flags
  from measure.doc_blocks import replace_block
  config, write = flags.FLAGS.config, flags.FLAGS.write
  if config.model.family != "gpt2" or config.moe.experts:
    sys.exit(f"error: --config is a {config.model.family} model{' with experts' * bool(config.moe.experts)}; "
             "the torch side is transformers' dense GPT2Block: give a dense configs/gpt2.py variant.")
  if config.precision.compute not in TORCH_DTYPES:
    sys.exit(f"error: precision.compute={config.precision.compute!r} has no torch peer here; use bfloat16 "
             "(torch's autocast) or float32.")
  if not SIDECAR.exists():
    sys.exit(f"error: the transformers sidecar {SIDECAR} is missing; set it up as "
             "tests/hf_reference_requirements.txt says.")
  try:
    if write:  # a page without the block is refused before the tracing
      replace_block(PAGE.read_text(), BLOCK, "")
  except ValueError as error:
    sys.exit(f"error: {PAGE.name} has {error}")
  budget, torch_record = meshlm_vs_torch(config)
  cfg = budget.cfg
  head = (f"GPT-2 layer of width {cfg.embed_dim}, {cfg.num_heads} heads, MLP {cfg.mlp_dim}, one sequence of "
          f"{cfg.max_len} tokens, {cfg.compute_dtype}, remat {cfg.remat}; a D-unit is {budget.d_unit:,} bytes per "
          "token (one bfloat16 vector of the width).")
  if budget.rule:
    head += (f" meshlm's attention is model.attention={budget.rule}, which a CPU cannot trace: its q, k, v, output "
             "and log-sum-exp are counted by rule.")
  text = f"{head}\n\n{table(budget, torch_record)}\n"
  print(text, end="")
  if write:
    made = (f"\nMade by `python tools/saved_vs_torch.py {' '.join(sys.argv[1:])}` at commit {commit()} "
            f"(jax {metadata.version('jax')}; torch {torch_record['torch']}, "
            f"transformers {torch_record['transformers']}).\n")
    PAGE.write_text(replace_block(PAGE.read_text(), BLOCK, text + made))


if __name__ == "__main__":
  if sys.argv[1:2] == [TORCH_SIDE]:
    print(json.dumps(torch_saved(**json.loads(sys.argv[2]))))
  else:
    from absl import app, flags as absl_flags
    from run.config_flag import define_config_flag
    define_config_flag("configs/gpt2.py:124m", "A dense GPT-2 config; --config.<field> sets fields.")
    absl_flags.DEFINE_bool("write", False, f"Also rewrite {PAGE.name}'s <!-- {BLOCK} --> block with the table.")
    app.run(main)
