"""Direct preference optimisation (DPO) and its variants: the objective that `objective=dpo` trains.

A batch holds pairs: a prompt with the answer preferred (`chosen_*`) and with the answer passed over
(`rejected_*`), each as inputs, targets and a mask of the answer's tokens (input_pipeline/data.py). The policy's
log-probability of each answer is compared with a frozen reference's (the weights the run started from, kept
in the train state as "reference"), and the loss pushes the chosen answer's ratio above the rejected one's.
The losses follow TRL's DPOTrainer (trl 1.16), which tests/test_preference.py checks them against:

  sigmoid  -log sigmoid(beta x delta), delta = (chosen - reference) - (rejected - reference)   (Rafailov et al.)
  robust   the same with labels flipped at rate label_smoothing, unbiased (Chowdhury et al.)
  ipo      (delta per answer token - 1 / (2 beta))^2                                           (Azar et al.)
  simpo    -log sigmoid(beta x (chosen - rejected per answer token) - gamma), no reference     (Meng et al.)

Rewards (beta x the log-ratio to the reference; SimPO's are beta x the mean log-probability), their margin and
how often the chosen answer's is the larger are logged with the loss. `sft_weight` adds that many times the chosen
answers' mean negative log-likelihood per token (TRL's "sft" loss beside another; RPO, Pang et al. 2024), which keeps
DPO from lowering the chosen answers' probability along with the rejected ones'.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from input_pipeline.data import ANSWERS, PAIR_FIELDS as FIELDS
from model.moe import AUX_LOSS
from parallel import context
from parallel.mesh import SEQUENCE
from training import grpo

OBJECTIVES = ("lm", "dpo", "grpo")  # grpo: training/grpo.py
LOSSES = ("sigmoid", "robust", "ipo", "simpo")
LOSS = "preference_loss"  # the statistic the step reports as its loss


@dataclasses.dataclass(frozen=True)
class Preference:
  """The settings of a preference objective (config.dpo)."""
  loss: str
  beta: float
  label_smoothing: float
  gamma: float
  sft_weight: float = 0.0

  @property
  def uses_reference(self) -> bool:
    return self.loss != "simpo"


def settings(config) -> Preference | None:
  """config's preference objective, or None when it trains a language model."""
  if config.objective != "dpo":
    return None
  return Preference(loss=config.dpo.loss, beta=config.dpo.beta, label_smoothing=config.dpo.label_smoothing,
                    gamma=config.dpo.gamma, sft_weight=config.dpo.sft_weight)


def keeps_reference(config) -> bool:
  """Whether config's objective compares the policy with the weights it started from: DPO's losses but SimPO, and
  GRPO with a KL term (training/grpo.py)."""
  return any(s is not None and s.uses_reference for s in (settings(config), grpo.settings(config)))


def batch_keys() -> tuple[str, ...]:
  return tuple(f"{answer}_{field}" for answer in ANSWERS for field in FIELDS)


def answer_log_probs(layout, params, batch):
  """(chosen, rejected): each pair's log-probability of its two answers, float32 [B] each, and the router
  statistics. Both answers run as one batch of 2B rows, pair i's at rows 2i and 2i + 1, so a data-parallel
  shard holds both answers of its pairs."""
  model = nnx.merge(layout.graphdef, params)
  b, t = batch["chosen_inputs"].shape
  rows = {field: jnp.stack([batch[f"{answer}_{field}"] for answer in ANSWERS], 1).reshape(2 * b, t)
          for field in FIELDS}
  order_T = context.token_order(layout.context, t, layout.mesh.shape[SEQUENCE])
  if order_T is None:
    log_probs_R, stats = model.sequence_log_probs(rows["inputs"], rows["targets"], rows["mask"].astype(jnp.float32))
  else:  # ring attention's zig-zag order: a row's sum does not care about the order of its positions
    ordered = {field: rows_RT[:, order_T] for field, rows_RT in rows.items()}
    log_probs_R, stats = model.sequence_log_probs(ordered["inputs"], ordered["targets"],
                                                  ordered["mask"].astype(jnp.float32), jnp.asarray(order_T))
  log_probs_B2 = log_probs_R.reshape(b, 2)
  return log_probs_B2[:, 0], log_probs_B2[:, 1], stats


def with_reference(layout, reference, batch):
  """`batch` with the reference's log-probabilities of its answers (`reference_chosen`, `reference_rejected`,
  [B]); unchanged where the loss uses no reference."""
  if not layout.preference.uses_reference:
    return batch
  chosen_B, rejected_B, _ = answer_log_probs(layout, jax.lax.stop_gradient(reference), batch)
  return {**batch, "reference_chosen": chosen_B, "reference_rejected": rejected_B}


def objective(layout, params, batch):
  """(the preference loss plus any router losses, statistics): what `objective=dpo` differentiates."""
  settings_, beta = layout.preference, layout.preference.beta
  chosen_B, rejected_B, stats = answer_log_probs(layout, params, batch)
  lengths = {answer: jnp.maximum(batch[f"{answer}_mask"].sum(-1), 1).astype(jnp.float32) for answer in ANSWERS}
  # Summed over the batch's chosen tokens, not per row: TRL's "sft" loss is the mean over all of them.
  nll = -chosen_B.sum() / batch["chosen_mask"].sum().astype(jnp.float32) if settings_.sft_weight else 0.0
  if settings_.uses_reference:
    chosen_B, rejected_B = chosen_B - batch["reference_chosen"], rejected_B - batch["reference_rejected"]
  delta_B = chosen_B - rejected_B
  if settings_.loss == "sigmoid":
    losses_B = -jax.nn.log_sigmoid(beta * delta_B)
  elif settings_.loss == "robust":
    smoothing = settings_.label_smoothing
    losses_B = (-(1 - smoothing) * jax.nn.log_sigmoid(beta * delta_B)
                + smoothing * jax.nn.log_sigmoid(-beta * delta_B)) / (1 - 2 * smoothing)
  else:  # ipo and simpo compare the answers' log-probabilities per token
    per_token_B = chosen_B / lengths["chosen"] - rejected_B / lengths["rejected"]
    losses_B = ((per_token_B - 1 / (2 * beta)) ** 2 if settings_.loss == "ipo"
                else -jax.nn.log_sigmoid(beta * per_token_B - settings_.gamma))
  if settings_.loss == "simpo":
    chosen_B, rejected_B = chosen_B / lengths["chosen"], rejected_B / lengths["rejected"]
  rewards = {answer: jax.lax.stop_gradient(beta * r_B) for answer, r_B in zip(ANSWERS, (chosen_B, rejected_B))}
  loss = losses_B.mean() + settings_.sft_weight * nll
  figures = {LOSS: loss, "dpo_chosen_reward": rewards["chosen"].mean(),
             "dpo_rejected_reward": rewards["rejected"].mean(),
             "dpo_margin": (rewards["chosen"] - rewards["rejected"]).mean(),
             "dpo_accuracy": (rewards["chosen"] > rewards["rejected"]).mean(dtype=jnp.float32)}
  return loss + stats.get(AUX_LOSS, 0.0), {**figures, **stats}
