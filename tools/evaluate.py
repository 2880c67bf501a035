"""Benchmark scores of a meshlm run or an imported checkpoint through lm-evaluation-harness, or a split's perplexity.

  python tools/evaluate.py --workdir runs/tiny --tasks hellaswag,lambada_openai --limit 100 --step 2000
  python tools/evaluate.py --init_from hf:checkpoints/llama --tasks my_task --include_path tasks/
  python tools/evaluate.py --workdir runs/tiny --perplexity val

--tasks are the harness's task names (its registry, whose datasets come from the hub) or those of the
task files (YAML) under --include_path; the model is meshlm's own class (interop/harness.py) on the
sharded model, laid out on the run's mesh or --mesh. --perplexity scores the run's token split in
consecutive windows of the model's length instead. Prints the harness's table (or the perplexity), and
with --output writes the results as JSON.
"""

import importlib.util
import json
import sys
from pathlib import Path

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "A meshlm run's workdir.")
_STEP = flags.DEFINE_integer("step", -1, "With --workdir: the checkpoint step; -1 takes the newest.")
_INIT_FROM = flags.DEFINE_string("init_from", None, "hf:DIR, a Hugging Face checkpoint with its tokenizer.")
_TASKS = flags.DEFINE_list("tasks", [], "lm-evaluation-harness task names.")
_INCLUDE_PATH = flags.DEFINE_string("include_path", None, "A folder of task YAML files, besides the harness's own.")
_LIMIT = flags.DEFINE_integer("limit", None, "Documents per task (all by default).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Requests (or --perplexity's windows) scored per forward pass.")
_MESH = flags.DEFINE_string("mesh", "", "Axis sizes like data=2,tensor=4 (others 1); default the run's mesh.")
_COMPUTE = flags.DEFINE_enum("compute", None, ["float32", "bfloat16", "float16"],
                              "The matmuls' precision; default the run's (an import's: configs/base.py's).")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "With --init_from: positions a request may span; default the "
                                "checkpoint's max_position_embeddings (GPT-2's are its own).")
_PERPLEXITY = flags.DEFINE_enum("perplexity", None, ["train", "val"], "Score this split of the run's tokens.")
_OUTPUT = flags.DEFINE_string("output", None, "Write the results here as JSON.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  if importlib.util.find_spec("lm_eval") is None:
    sys.exit("evaluate.py: lm-evaluation-harness is not installed; pip install -e '.[eval]'.")
  # Imported after flag parsing, like train.py: jax reads its flags when first imported.
  from input_pipeline import data  # pylint: disable=import-outside-toplevel
  from interop.harness import MeshlmLM, from_hf, split_perplexity  # pylint: disable=import-outside-toplevel
  from interop.harness_tasks import evaluate, task_manager  # pylint: disable=import-outside-toplevel
  from parallel.mesh import mesh_sizes  # pylint: disable=import-outside-toplevel
  from run.saved_run import from_checkpoint  # pylint: disable=import-outside-toplevel
  from training.step import make_eval_step  # pylint: disable=import-outside-toplevel
  try:
    if (_WORKDIR.value is None) == (_INIT_FROM.value is None):
      raise ValueError("give one of --workdir (a meshlm run) and --init_from=hf:DIR (a Hugging Face checkpoint).")
    if bool(_TASKS.value) == bool(_PERPLEXITY.value):
      raise ValueError("give one of --tasks (harness tasks) and --perplexity (a split of the run's tokens).")
    if _PERPLEXITY.value and not _WORKDIR.value:
      raise ValueError("--perplexity scores the token split a run trained on: give its --workdir.")
    if _BATCH_SIZE.value < 1:
      raise ValueError(f"--batch_size={_BATCH_SIZE.value} scores nothing; give 1 or more requests (or --perplexity "
                       "windows) per forward pass.")
    manager = task_manager(_TASKS.value, _INCLUDE_PATH.value) if _TASKS.value else None  # before any compile
    mesh = mesh_sizes(_MESH.value) if _MESH.value else None
    if _WORKDIR.value:
      config, layout, params, tokenizer, _ = from_checkpoint(_WORKDIR.value, _STEP.value, mesh, _COMPUTE.value)
    else:
      config, layout, params, tokenizer = from_hf(_INIT_FROM.value, mesh, _COMPUTE.value, _MAX_LEN.value)
    if _PERPLEXITY.value:
      split = data.open_split(config.data, _PERPLEXITY.value, vocab_size=config.model.vocab_size)
      perplexity, tokens = split_perplexity(layout, params, split, make_eval_step(layout), _BATCH_SIZE.value)
      results = {"perplexity": perplexity, "tokens": tokens, "split": _PERPLEXITY.value}
      print(f"{_PERPLEXITY.value} perplexity {perplexity:.4f} over {tokens:,} tokens")
    else:
      from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel
      results = evaluate(MeshlmLM(layout, params, tokenizer, _BATCH_SIZE.value), _TASKS.value, manager,
                         _LIMIT.value)
      print(make_table(results))
  except ValueError as error:
    sys.exit(f"evaluate.py: {error}")
  if _OUTPUT.value:
    Path(_OUTPUT.value).write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
  app.run(main)
