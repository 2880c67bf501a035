"""Ablation recipes: the textbook comparisons as configs, run by tools/sweep.py.

  python tools/sweep.py --recipe adamw_vs_l2
  python tools/sweep.py --recipe precision --set steps=30 --out runs/sweeps/precision_short
  python tools/sweep.py --recipe all --write docs        # docs/research.md's tables and figures, docs/<recipe>.md

Each recipe is the tiny model on the built-in corpus, sized to finish in a few
minutes on a 2-core CPU: a base config, the fields every run shares, and the
runs themselves (a grid, whose product is taken, or a list of cases). Adding a
point to a comparison is adding a value here, not writing code.
"""

import dataclasses
import itertools

from parallel import schedules

# What every recipe shares: short runs logged often, evaluated twice, checkpointed
# so an interrupted sweep resumes mid-run, and no closing text sample.
SHORT_RUN = {"steps": 120, "batch_size": 8, "log_every": 10, "eval_every": 60, "eval_batches": 4,
             "sample_tokens": 0, "checkpoint.every": 60, "checkpoint.keep": 1}


FIVE_SEEDS = (0, 1, 2, 3, 4)  # a recipe's runs repeated to give each cell an interval (measure/seed_stats.py)


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str
  question: str  # the comparison, in one sentence, for the table's caption
  grid: tuple = ()  # (field, (values...)) pairs; every combination is one run
  cases: tuple = ()  # or explicit runs: dicts of field -> value
  fixed: dict = dataclasses.field(default_factory=dict)  # fields every run shares
  seeds: tuple = (0,)
  # What the seeds set: `seed` (the initial weights and the data order) or `data.seed` (the order alone).
  seed_field: str = "seed"
  config: str = "configs/gpt2.py:tiny"
  devices: int = 1  # simulated CPU devices (XLA flag); a GPU or TPU host uses its own
  columns: dict = dataclasses.field(default_factory=dict)  # extra table column -> fn(run's fields) -> str
  target_loss: float = 0.0  # > 0: a column with the first logged step whose train loss reaches it
  versus: str = ""  # a field: the figure plots final validation loss against it, a line per other setting
  expert_balance: bool = False  # columns of how evenly the experts were chosen over the run's second half
  # Compute matching: each run's steps are those that spend `budget` of `match` (tokens, the textbook's training
  # FLOPs, or "seconds@<kind>": a step's modelled seconds on one device of that kind, measure/sweep.py step_cost),
  # whatever its batch or model; "" runs the steps configured.
  match: str = ""
  budget: float = 0.0
  # With several seeds, the cell the others are compared with (fields -> values it has); empty: the first cell.
  baseline: dict = dataclasses.field(default_factory=dict)
  cumulative: bool = False  # each cell adds to the one before it, and is compared with that one instead
  # A field: each cell is compared instead with the best cell (lowest mean) among those that differ from it in this
  # field alone, as whether a best learning rate stands out from its neighbours; "": the baseline (or cumulative)
  best_within: str = ""

  def runs(self) -> list[dict]:
    """The varied fields of every run, in order (seed last)."""
    if self.grid and self.cases:
      raise ValueError(f"recipe {self.name!r} gives both a grid and cases; give one.")
    if self.grid:
      fields = [field for field, _ in self.grid]
      points = [dict(zip(fields, values)) for values in itertools.product(*(v for _, v in self.grid))]
    else:
      points = [dict(case) for case in self.cases] or [{}]
    return [{**point, self.seed_field: seed} for point in points for seed in self.seeds]


PIPELINE_FIXED = {**SHORT_RUN, "mesh.pipeline": 4, "mesh.data": 1, "model.num_layers": 4,
                  "pipeline.schedule": "gpipe", "batch_size": 16, "steps": 40, "eval_every": 40,
                  "checkpoint.every": 40}


# The wsd recipe's stable run's folder, each seed's decays branching from that seed's.
WSD_STABLE = "optimizer.name=adamw,schedule.decay=wsd,steps=200,branch_from=,seed={seed}"


SPEEDRUN_WINDOWS = "40:model.sliding_window=32;80:model.sliding_window=64"
# The speedrun recipe's ideas in the order they are added, each a setting and the baseline's (GPT-2 as configured);
# Muon at a rate near its best in muon_vs_adamw, AdamW at the config's 3e-3.
SPEEDRUN_IDEAS = ((("model.activation", "relu2"), ("model.activation", "gelu")),
                  (("model.zero_init_out", True), ("model.zero_init_out", False)),
                  (("model.logit_softcap", 15.0), ("model.logit_softcap", 0.0)),
                  ((("optimizer.name", "muon"), ("optimizer.lr", 0.01)),
                   (("optimizer.name", "adamw"), ("optimizer.lr", 0.003))),
                  (("model.unet_skips", True), ("model.unet_skips", False)),
                  (("model.value_embeds", 1), ("model.value_embeds", 0)),  # the tiny model's 2 layers share one
                  (("model.fp8_head", True), ("model.fp8_head", False)),
                  # The curriculum's phases (training/curriculum.py) over the 120 steps of SHORT_RUN at 128 positions:
                  # attention windows of 32 then 64 positions before the whole context, then also half the batch for
                  # the first 40 steps, then also sequences half as long.
                  (("curriculum", SPEEDRUN_WINDOWS), ("curriculum", "")),
                  (("curriculum", f"40:batch_size=4,{SPEEDRUN_WINDOWS[3:]}"), ("curriculum", "")),
                  (("curriculum", f"40:batch_size=4,model.max_len=64,{SPEEDRUN_WINDOWS[3:]}"), ("curriculum", "")),
                  (("model.qk_norm", True), ("model.qk_norm", False)))


def _stacked(ideas, upto: int) -> dict:
  """A case with the first `upto` ideas' settings and the others' baseline values (every case names every field,
  so that the table has a column for each). A later idea's setting replaces an earlier one's of the same field;
  a baseline value only fills a field no idea set."""
  case = {}
  for index, (idea, baseline) in enumerate(ideas):
    pairs = lambda chosen: chosen if isinstance(chosen[0], tuple) else (chosen,)
    if index < upto:
      case.update(pairs(idea))
    else:
      for field, value in pairs(baseline):
        case.setdefault(field, value)
  return case


def _bubble(formula):
  """A table column: `formula` (schedules.bubble_over_total or _over_ideal) at the run's micro-batch count."""
  stages = int(PIPELINE_FIXED["mesh.pipeline"])
  return lambda fields: f"{formula(stages=stages, micro=int(fields['pipeline.microbatches'])):.3f}"


RECIPES = {r.name: r for r in [
    Recipe("adamw_vs_l2",
           "Decoupled weight decay (AdamW) against decay as an L2 term in Adam's gradient, at two strengths.",
           grid=(("optimizer.name", ("adamw", "adam_l2")), ("optimizer.weight_decay", (0.1, 1.0))),
           fixed=SHORT_RUN, seeds=FIVE_SEEDS),
    Recipe("schedule",
           "Linear warmup against none, and cosine decay against a constant rate, at a high peak rate.",
           grid=(("schedule.warmup_steps", (0, 30)), ("schedule.decay", ("cosine", "constant"))),
           fixed={**SHORT_RUN, "optimizer.lr": 1e-2}, seeds=FIVE_SEEDS,
           baseline={"schedule.warmup_steps": 30, "schedule.decay": "cosine"}),  # the usual recipe
    Recipe("optimizers",
           "Plain SGD against SGD with momentum against AdamW, each at a rate that suits it.",
           cases=({"optimizer.name": "sgd", "optimizer.lr": 1.0},
                  {"optimizer.name": "momentum", "optimizer.lr": 0.1},
                  {"optimizer.name": "adamw", "optimizer.lr": 3e-3}),
           fixed=SHORT_RUN, seeds=FIVE_SEEDS, baseline={"optimizer.name": "adamw"}),
    # Muon's updates are scaled to AdamW's RMS (training/muon.py), so one grid of rates serves both.
    Recipe("muon_vs_adamw",
           "Muon against AdamW at equal tokens, each over the same six peak rates.",
           grid=(("optimizer.name", ("adamw", "muon")), ("optimizer.lr", (0.0003, 0.001, 0.003, 0.01, 0.03, 0.1))),
           fixed=SHORT_RUN, target_loss=3.0, seeds=FIVE_SEEDS,
           baseline={"optimizer.name": "adamw", "optimizer.lr": 0.001}),  # AdamW's best rate on seed 0
    # The decays branch from the first run's checkpoints, which sit in the same sweep folder ({out}).
    Recipe("wsd",
           "Warmup-stable-decay against cosine and schedule-free AdamW at budgets of 80 and 120 steps, WSD's "
           "decays branched from one 200-step run's stable phase (each seed's from its own).",
           cases=tuple({"optimizer.name": name, "schedule.decay": decay, "steps": steps, "branch_from": branch}
                       for name, decay, steps, branch in (
                           ("adamw", "wsd", 200, ""), ("adamw", "wsd", 80, f"{{out}}/{WSD_STABLE}:60"),
                           ("adamw", "wsd", 120, f"{{out}}/{WSD_STABLE}:100"), ("adamw", "cosine", 80, ""),
                           ("adamw", "cosine", 120, ""), ("schedule_free_adamw", "constant", 80, ""),
                           ("schedule_free_adamw", "constant", 120, ""))),
           fixed={**SHORT_RUN, "schedule.decay_steps": 20, "eval_every": 40, "checkpoint.every": 20,
                  "checkpoint.keep": 10},
           seeds=FIVE_SEEDS, baseline={"schedule.decay": "cosine", "steps": 120}),
    # Widths grow by heads of 16 with the MLP 4x the width; muP's base is the narrowest (model/mup.py).
    Recipe("mup",
           "Validation loss against the learning rate at three widths: the standard parametrisation's best rate "
           "moves with the width, muP's stays.",
           # muP at its base width is the standard parametrisation bit for bit (tests/test_mup.py): not run twice.
           cases=tuple({"mup.base_width": base, "model.embed_dim": width, "model.num_heads": width // 16,
                        "model.mlp_dim": 4 * width, "optimizer.lr": lr}
                       for base in (0, 64) for width in (64, 128, 256) for lr in (1e-3, 3e-3, 1e-2, 3e-2)
                       if width != base),
           fixed=SHORT_RUN, versus="optimizer.lr", seeds=FIVE_SEEDS, best_within="optimizer.lr"),
    # float16 (with loss scaling) joins as one more value of precision.compute.
    Recipe("precision",
           "Matmuls in float32 against bfloat16; master weights, norms, softmax and loss stay float32.",
           grid=(("precision.compute", ("float32", "bfloat16")),),
           fixed={**SHORT_RUN, "steps": 60, "eval_every": 30, "checkpoint.every": 30}, seeds=FIVE_SEEDS),
    Recipe("batch_vs_accumulation",
           "A small batch, a 4x batch, and the 4x batch as 4 accumulated micro-batches (same math, less memory).",
           cases=({"batch_size": 4, "grad_accum": 1}, {"batch_size": 16, "grad_accum": 1},
                  {"batch_size": 16, "grad_accum": 4}),
           fixed=SHORT_RUN, seeds=FIVE_SEEDS, baseline={"batch_size": 16, "grad_accum": 1}),
    # DeepSeek-V3's routing on every layer (configs/deepseek.py): sigmoid scores, groups, a shared expert.
    Recipe("moe_balance",
           "Keeping DeepSeek-style experts balanced: nothing, the auxiliary loss (Switch Transformer's), and "
           "DeepSeek-V3's selection bias moved against each expert's load at two rates, with no loss term.",
           cases=({"moe.bias_rate": 0.0, "moe.balance_weight": 0.0},
                  {"moe.bias_rate": 0.0, "moe.balance_weight": 0.01},
                  {"moe.bias_rate": 0.001, "moe.balance_weight": 0.0},
                  {"moe.bias_rate": 0.01, "moe.balance_weight": 0.0}),
           seeds=FIVE_SEEDS, config="configs/deepseek.py:deepseek3_tiny",
           fixed={**SHORT_RUN, "moe.first_dense": 0, "moe.dense_width": 0}, expert_balance=True),
    # DeepSeek-V3's tiny shape as configured (a dense first layer, bias balancing), its modules weighted 0.3.
    Recipe("mtp",
           "Multi-token prediction against next-token prediction alone at equal tokens: DeepSeek-V3's one module, "
           "and two; the validation loss is the next token's in every run.",
           cases=({"model.mtp_depth": 0}, {"model.mtp_depth": 1}, {"model.mtp_depth": 2}),
           seeds=FIVE_SEEDS, config="configs/deepseek.py:deepseek3_tiny", fixed=SHORT_RUN),
    Recipe("speedrun",
           "The modded-nanogpt speedrun's ideas added one at a time to the tiny GPT-2 at equal tokens: ReLU-squared, "
           "zero-initialised output projections, logits soft-capped at 15, Muon, U-net skips, value embeddings, "
           "an fp8 head, attention windows growing over training, a batch-size warmup, a sequence-length warmup, "
           "then QK-norm.",
           cases=tuple(_stacked(SPEEDRUN_IDEAS, upto) for upto in range(len(SPEEDRUN_IDEAS) + 1)),
           fixed=SHORT_RUN, match="tokens", budget=SHORT_RUN["steps"] * SHORT_RUN["batch_size"] * 128,  # 128 positions
           target_loss=3.0, seeds=FIVE_SEEDS, cumulative=True),
    Recipe("pipeline_bubble",
           "GPipe over 4 stages on 4 simulated devices: more micro-batches, smaller bubble, same losses.",
           grid=(("pipeline.microbatches", (1, 2, 4, 8, 16)),),
           fixed=PIPELINE_FIXED, devices=4,
           columns={"bubble/total (P-1)/(M+P-1)": _bubble(schedules.bubble_over_total),
                    "bubble/ideal (P-1)/M": _bubble(schedules.bubble_over_ideal)}),
]}
