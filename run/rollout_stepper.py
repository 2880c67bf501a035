"""The stepper of objective=grpo: each step's batch sampled from the weights the step starts from
(training/rollouts.py), so batches are made one at a time, not prefetched; evaluation scores greedy answers to
held-out prompts."""

import time

from run.local_stepper import LocalStepper
from training.rollouts import Rollouts
from training.step import model_weights


class RolloutStepper(LocalStepper):
  """LocalStepper with batches sampled from its own state; `tokenizer` turns prompts into ids and completions
  into the texts a reward reads."""
  eval_metric = "eval_reward"

  def __init__(self, config, layout, state, train_split, val_split, stop, tokenizer):
    self._rollouts = Rollouts(config, layout, tokenizer)  # refuses bad prompts before the step compiles
    super().__init__(config, layout, state, train_split, val_split, stop)

  def __enter__(self):
    self._batches = (step for step in range(int(self.state["step"]), self._config.steps))  # closed on exit
    return self

  def _next_batch(self):
    step = next(self._batches)
    began = time.perf_counter()
    batch, figures = self._rollouts.batch(model_weights(self.layout, self.state), step)
    return step, batch, figures, {"generation_seconds": time.perf_counter() - began}

  def evaluate(self, done) -> float:
    return self._rollouts.evaluate(model_weights(self.layout, done.state))
