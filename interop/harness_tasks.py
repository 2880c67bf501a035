"""lm-evaluation-harness's tasks and its evaluation run on a model, each failure refused in one line: a task
name the harness lacks before any compile, and task data that cannot be found (tools/evaluate.py's --tasks)."""

import lm_eval
from lm_eval.tasks import TaskManager


def task_manager(tasks: list, include_path: str | None = None):
  """The harness's TaskManager for `tasks` (its own and those under `include_path`); refuses a name it lacks."""
  manager = TaskManager(include_path=include_path)
  unknown = [task for task in tasks if not manager.match_tasks([task])]
  if unknown:
    raise ValueError(f"--tasks {', '.join(unknown)}: not among lm-evaluation-harness's tasks"
                     f"{' or those under ' + include_path if include_path else ''}; give a task name it lists "
                     "(lm-eval ls tasks) or a folder of task files as --include_path.")
  return manager


def evaluate(model, tasks: list, manager, limit: int | None = None) -> dict:
  """The harness's results for `tasks` on an lm_eval model, with each document's requests and answers."""
  try:
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=limit, log_samples=True)
  except FileNotFoundError as error:  # the datasets library's, as the tasks are built, before a request is scored
    raise ValueError(f"the data of --tasks {','.join(tasks)} cannot be found ({error}); put it where the task's "
                     "YAML says (dataset_path, dataset_kwargs) or correct the YAML.") from None
