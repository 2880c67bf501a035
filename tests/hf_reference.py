"""The transformers side of tests/test_hf_checkpoint.py, run by the sidecar interpreter (.venv-hf, Python 3.11).

  .venv-hf/bin/python tests/hf_reference.py JOBS.json

JOBS.json is a list of jobs, run in order in one process (torch and
transformers take seconds to import, so the tests batch their questions):
  {"make": "gpt2" | "llama" | "qwen2" | "qwen3" | "mistral" | "mixtral" | "qwen3_moe" | "qwen2_moe" | "olmoe"
           | "gemma2" | "gemma3" | "deepseek_v3", "dir": D, "config": {...}, "seed": S, "save": {...}}
      a model with every weight random (norms and biases too), save_pretrained(D, **save); with num_mtp_layers,
      random prediction modules beside it where DeepSeek-V3's checkpoint holds them
  {"logits": D, "tokens": T.npy, "out": O.npy}          float32 logits of D on the tokens
  {"loss": D, "inputs": I.npy, "targets": T.npy, "out": O.npy}
      transformers' own causal-LM loss with `targets` as the shifted labels
  {"modules": D, "tokens": T.npy, "out": O.npz}          DeepSeek-V3's multi-token prediction modules' logits
  {"chat": D, "conversations": [...], "out": O.json}   apply_chat_template's text and ids of each conversation
  {"harness": D, "tasks": [...], "include_path": P, "max_length": L, "out": O.json}
      lm-evaluation-harness's own Hugging Face class on D: each task's metrics and each document's responses
  {"dpo": D, "reference": R, "examples": [{"prompt_ids", "chosen_ids", "rejected_ids"}, ...], "loss_type": L, "beta": B,
   "label_smoothing": S, "gamma": G, "sft_weight": W, "out": O.npz}
      TRL's DPOTrainer (trl 1.16; CPOTrainer's loss for "simpo") on D against the model in R: the loss,
      the mean chosen and rejected rewards, the mean margin and accuracy, and the loss's gradient of each weight;
      with W > 0, TRL's "sft" loss added at weight W
  {"grpo": D, "reference": R, "batch": B.npz, "group": G, "loss_type": L, "beta": K, "temperature": T,
   "scale_rewards": S, "out": O.npz}
      TRL's GRPOTrainer (trl 1.16) on D, the model in R as its reference: for B's prompt_ids, completion_ids,
      completion_mask and rewards, the advantages as TRL forms them, its loss (_compute_loss), its logged KL and
      the loss's gradient of each weight
  {"peft": D, "adapter": A, "tokens": T.npy, "out": O.npy}
      float32 logits of D with the PEFT adapter directory A loaded onto it (PeftModel.from_pretrained)
  {"compare": [D1, D2], "out": O.json}                   whether two dirs load to identical weights (and tying
                                                         and rotary settings),
                                                         and D2's dropout rates
"""

import json
import re
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

CLASSES = {"gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
           "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
           "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
           "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)}


def load(directory):
  # Eager attention: the plain softmax(QK^T)V, in float32.
  return transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, attn_implementation="eager").eval()


def randomize(module):
  with torch.no_grad():
    for name, weight in module.named_parameters():
      # Norm scales near 1 keep activations in range; everything else plainly random.
      base = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "norm.weight")) else 0.0
      weight.copy_(base + 0.1 * torch.randn_like(weight))
    for name, buffer in module.named_buffers():  # DeepSeek's router bias is a buffer, saved with the weights
      if name.endswith("e_score_correction_bias"):
        buffer.copy_(0.1 * torch.randn_like(buffer))


def make(job):
  config_class, model_class = CLASSES[job["make"]]
  torch.manual_seed(job["seed"])
  model = model_class(config_class(**job["config"]))
  randomize(model)
  model.save_pretrained(job["dir"], **job["save"])
  if getattr(model.config, "num_mtp_layers", 0):
    add_prediction_modules(model, job["dir"])


def add_prediction_modules(model, directory):
  """Random multi-token prediction modules added to the saved model's file where DeepSeek-V3's checkpoint holds
  them, as layers num_hidden_layers + k (save_pretrained writes none): each module's block saved by transformers
  as a layer of a model whose layers are those blocks, so it takes the checkpoint's names (one tensor per
  expert) whatever transformers holds inside, and enorm, hnorm, eh_proj and shared_head.norm beside it."""
  from transformers.modeling_layers import MtpModel
  modules = MtpModel(model, model.config.num_mtp_layers)
  randomize(modules)
  blocks = type(model)(model.config.get_mtp_config())
  for layer, module in zip(blocks.model.layers, modules.layers):
    layer.load_state_dict(module.mtp_block.state_dict())
  first, file = model.config.num_hidden_layers, f"{directory}/model.safetensors"
  with tempfile.TemporaryDirectory() as held:
    blocks.save_pretrained(held)
    renamed = lambda name: re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{first + int(m[1])}.", name)
    saved = load_file(f"{held}/model.safetensors")
    tensors = {**load_file(file), **{renamed(name): tensor for name, tensor in saved.items()
                                     if name.startswith("model.layers.")}}
  names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "post_norm": "shared_head.norm"}
  for k, module in enumerate(modules.layers):
    for ours, theirs in names.items():
      tensors[f"model.layers.{first + k}.{theirs}.weight"] = getattr(module, ours).weight.detach().clone()
  save_file(tensors, file, metadata={"format": "pt"})


def logits(job):
  tokens = torch.from_numpy(np.load(job["tokens"])).long()
  with torch.no_grad():
    np.save(job["out"], load(job["logits"])(input_ids=tokens).logits.numpy())


def loss(job):
  inputs = torch.from_numpy(np.load(job["inputs"])).long()
  targets = torch.from_numpy(np.load(job["targets"])).long()
  with torch.no_grad():
    # shift_labels: the targets are already the next tokens, as meshlm's batches hold them.
    out = load(job["loss"])(input_ids=inputs, labels=targets, shift_labels=targets)
  np.save(job["out"], out.loss.numpy())


def modules(job):
  """Each multi-token prediction module's logits on the tokens as transformers' MtpModel computes them, module k on
  the first T - 1 - k positions (reading token i + k beside the previous module's hidden state at i), saved as
  out["k"]; MtpModel reads the modules with its own loader and names."""
  from transformers.modeling_layers import MtpModel
  main = load(job["modules"])
  first, count = main.config.num_hidden_layers, main.config.num_mtp_layers
  # MtpModel finds the modules by the names DeepseekV3ForCausalLM skips when loading: layer 61's there, these here.
  main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{first + k}\..*" for k in range(count)]
  mtp = MtpModel.from_pretrained(main).eval()
  sequence = torch.from_numpy(np.load(job["tokens"])).long()
  inputs, out = sequence[:, :-1], {}
  with torch.no_grad():
    stack = main.model(input_ids=inputs, output_hidden_states=True)
    # Drafting reads hidden_states[-1] (generation/candidate_generator.py): the stack's output after its final norm.
    assert torch.equal(stack.hidden_states[-1], stack.last_hidden_state)
    hidden = stack.last_hidden_state
    for k in range(1, count + 1):
      kept = inputs.shape[1] - k
      embeds = mtp.embed_tokens(sequence[:, k:k + kept])
      positions = torch.arange(kept)[None].expand(len(sequence), -1)
      hidden = mtp.layers[k - 1](embeds, hidden[:, :kept], position_embeddings=mtp.rotary_emb(embeds, positions),
                                 position_ids=positions, past_key_values=None,
                                 **mtp.create_masks_for_mtp_layer(k - 1, embeds, None, positions))
      out[str(k)] = mtp._project_to_logits(hidden).numpy()
  np.savez(job["out"], **out)


def compare(job):
  first, second = (load(d) for d in job["compare"])
  a, b = first.state_dict(), second.state_dict()
  differ = sorted(k for k in a.keys() & b.keys() if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
  result = {"missing": sorted(a.keys() - b.keys()), "unexpected": sorted(b.keys() - a.keys()),
            "differ": differ, "tensors": len(a),
            "tied": [m.config.tie_word_embeddings for m in (first, second)],
            "rope": [getattr(m.config, "rope_parameters", None) for m in (first, second)],
            # every dropout rate the second (the export) would train with in transformers
            "dropout": {k: v for k, v in second.config.to_dict().items()
                        if ("pdrop" in k or "dropout" in k) and isinstance(v, float)}}
  with open(job["out"], "w") as f:
    json.dump(result, f)


def tokenize(job):
  """The ids transformers' own tokenizer gives a directory's texts (no special tokens added), and its eos id."""
  from transformers import AutoTokenizer
  tokenizer = AutoTokenizer.from_pretrained(job["tokenize"])
  with open(job["out"], "w") as f:
    json.dump({"ids": [tokenizer.encode(text, add_special_tokens=False) for text in job["texts"]],
               "eos": tokenizer.eos_token_id}, f)


def chat(job):
  """transformers' rendering of each conversation with the directory's chat template, as text and as ids."""
  from transformers import AutoTokenizer
  tokenizer = AutoTokenizer.from_pretrained(job["chat"])
  with open(job["out"], "w") as f:
    json.dump([{"text": tokenizer.apply_chat_template(messages, tokenize=False),
                "ids": list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])}
               for messages in job["conversations"]], f)


def harness(job):
  import lm_eval
  from lm_eval.tasks import TaskManager
  results = lm_eval.simple_evaluate(
      model="hf", model_args={"pretrained": job["harness"], "dtype": "float32", "attn_implementation": "eager",
                              "max_length": job["max_length"]},
      tasks=job["tasks"], task_manager=TaskManager(include_path=job["include_path"]), log_samples=True,
      batch_size=4, device="cpu")
  with open(job["out"], "w") as f:
    json.dump({"results": results["results"],
               "samples": {task: [[s["doc_id"], s["resps"]] for s in samples]
                           for task, samples in results["samples"].items()}}, f, default=float)


def dpo(job):
  import types

  from datasets import Dataset
  from tokenizers import Tokenizer, models
  from transformers import PreTrainedTokenizerFast
  from trl import DPOConfig, DPOTrainer
  from trl.experimental.cpo import CPOTrainer
  model, reference = load(job["dpo"]), load(job["reference"])
  # A tokenizer for the trainer's set-up only: the examples come tokenized, as meshlm's batch holds them.
  vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                      eos_token="t0", pad_token="t0")
  simpo = job["loss_type"] == "simpo"
  with tempfile.TemporaryDirectory() as folder:
    loss_types = ["sigmoid" if simpo else job["loss_type"]] + (["sft"] if job["sft_weight"] else [])
    args = DPOConfig(output_dir=folder, beta=job["beta"], loss_type=loss_types,
                     loss_weights=[1.0, job["sft_weight"]][:len(loss_types)],
                     label_smoothing=job["label_smoothing"], max_length=None, report_to=[], use_cpu=True,
                     bf16=False)  # TRL's default would run the reference under bfloat16 autocast
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list([{"prompt": "t1", "chosen": "t2", "rejected": "t3"}]))
    batch = trainer.data_collator(job["examples"])
    if simpo:  # the length-normalised log-probabilities CPOTrainer's simpo compares, through its own loss
      mask = batch["completion_mask"][:, 1:].float()
      logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
      per_token = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
      chosen, rejected = ((per_token * mask).sum(-1) / mask.sum(-1)).chunk(2)
      settings = types.SimpleNamespace(alpha=0.0, beta=job["beta"], simpo_gamma=job["gamma"], loss_type="simpo",
                                       label_smoothing=0.0, accelerator=types.SimpleNamespace(device="cpu"))
      losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(settings, chosen, rejected)
      loss = losses.mean()
      figures = {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
                 "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
                 "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item()}
    else:
      loss = trainer.compute_loss(model, batch)
      figures = {key: values[-1] for key, values in trainer._metrics["eval"].items()}  # eval: the model is in eval()
    loss.backward()
  np.savez(job["out"], loss=loss.item(), **{f"figure:{key}": value for key, value in figures.items()},
           **{f"grad:{name}": weight.grad.numpy() for name, weight in model.named_parameters()})


def grpo(job):
  from datasets import Dataset
  from tokenizers import Tokenizer, models
  from transformers import PreTrainedTokenizerFast
  from trl import GRPOConfig, GRPOTrainer
  from trl.trainer.utils import nanstd
  # TRL builds its reference from the path the policy was loaded from: load the reference's, then the policy's
  # weights into it.
  model = load(job["reference"])
  model.load_state_dict(load(job["grpo"]).state_dict())
  vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                      eos_token="t0", pad_token="t0")
  batch = {key: torch.from_numpy(value) for key, value in np.load(job["batch"]).items()}
  b, c = batch["completion_ids"].shape
  # The advantages as _generate_and_score_completions forms them from the rewards (multi_objective_aggregation's
  # default, one reward function).
  rewards = batch["rewards"].double()
  grouped = rewards.view(-1, job["group"])
  std = {"group": nanstd(grouped, dim=1).repeat_interleave(job["group"]), "batch": nanstd(rewards).expand_as(rewards),
         "none": None}[job["scale_rewards"]]
  advantages = rewards - grouped.nanmean(1).repeat_interleave(job["group"])
  if std is not None:
    advantages = advantages / (std + 1e-4)
  with tempfile.TemporaryDirectory() as folder:
    args = GRPOConfig(output_dir=folder, beta=job["beta"], loss_type=job["loss_type"], temperature=job["temperature"],
                      scale_rewards=job["scale_rewards"], num_generations=job["group"], per_device_train_batch_size=b,
                      max_completion_length=c, report_to=[], use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          processing_class=tokenizer, train_dataset=Dataset.from_list([{"prompt": "t1"}] * b))
    model.eval()  # "eval" mode: no accumulation normalizer, dropout off
    inputs = {"prompt_ids": batch["prompt_ids"].long(), "prompt_mask": torch.ones_like(batch["prompt_ids"]),
              "completion_ids": batch["completion_ids"].long(), "completion_mask": batch["completion_mask"].long(),
              "advantages": advantages.float(), "num_items_in_batch": batch["completion_mask"].sum().float()}
    if job["beta"]:
      with torch.no_grad():
        inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model.eval(), torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), c)
    loss = trainer._compute_loss(model, inputs)
    figures = {key: values[-1] for key, values in trainer._metrics["eval"].items()}
    loss.backward()
  np.savez(job["out"], loss=loss.item(), advantages=advantages.float().numpy(),
           **{f"figure:{key}": value for key, value in figures.items()},
           **{f"grad:{name}": weight.grad.numpy() for name, weight in model.named_parameters()})


def peft_logits(job):
  from peft import PeftModel
  tokens = torch.from_numpy(np.load(job["tokens"])).long()
  model = PeftModel.from_pretrained(load(job["peft"]), job["adapter"]).eval()
  with torch.no_grad():
    np.save(job["out"], model(input_ids=tokens).logits.numpy())


JOBS = {"make": make, "dpo": dpo, "grpo": grpo, "peft": peft_logits, "harness": harness, "logits": logits,
        "loss": loss, "modules": modules, "compare": compare, "tokenize": tokenize, "chat": chat}

if __name__ == "__main__":
  torch.set_num_threads(1)  # the tests run beside XLA on a small machine
  with open(sys.argv[1]) as f:
    for job in json.load(f):
      JOBS[next(kind for kind in JOBS if kind in job)](job)
