"""Every bad run setting is refused in one line before anything compiles or is written."""

import os

import numpy as np
import pytest

from helpers import tiny_config
from input_pipeline import token_files
from run.loop import train
from training.validate import check_run

# (overrides, what the one line must say); each is refused by training/validate.py or plan().
BAD = [
    ({"batch_size": 0}, r"batch_size=0 must be an integer of at least 1"),
    ({"steps": 0}, r"steps=0 must be an integer of at least 1"),
    ({"log_every": 0}, r"log_every=0 must be an integer of at least 1"),
    ({"eval_batches": 0, "eval_every": 5}, r"eval_batches=0 must be an integer of at least 1 while eval_every"),
    ({"data.prefetch": -1}, r"data.prefetch=-1 must be an integer of at least 0"),
    ({"model.num_layers": 0}, r"model.num_layers=0 must be an integer of at least 1"),
    ({"model.num_heads": -2}, r"model.num_heads=-2 must be an integer of at least 1"),
    ({"model.vocab_size": 0}, r"model.vocab_size=0 must be an integer of at least 1"),
    ({"model.max_len": 0}, r"model.max_len=0 must be an integer of at least 1"),
    ({"optimizer.lr": -1e-3}, r"optimizer.lr=-0.001 must be a finite number >= 0"),
    ({"optimizer.lr": float("nan")}, r"optimizer.lr=nan must be a finite number >= 0"),
    ({"optimizer.lr": 3.4e38}, r"optimizer.lr=3.4e\+38 is beyond any learning rate that trains \(at most 1e\+30\)"),
    ({"optimizer.clip_norm": float("inf")}, r"optimizer.clip_norm=inf must be a finite number >= 0"),
    ({"checkpoint.keep": 0}, r"checkpoint.keep=0 must be an integer of at least 1"),
    ({"checkpoint.keep": -1}, r"checkpoint.keep=-1 must be an integer of at least 1"),
    ({"pipeline.schedule": "zigzag"}, r"pipeline.schedule='zigzag' is unknown; use one of gpipe"),
    ({"nonfinite": "ignore"}, r"nonfinite='ignore' is unknown; use skip or stop"),
    ({"workdir": " "}, r"workdir is empty"),
    ({"optimizer.b1": 1.5}, r"optimizer.b1=1.5 must be in \[0, 1\)"),
    ({"optimizer.b2": 1.0}, r"optimizer.b2=1.0 must be in \[0, 1\)"),
    ({"optimizer.momentum": -0.1}, r"optimizer.momentum=-0.1 must be in \[0, 1\)"),
    ({"optimizer.eps": 0.0}, r"optimizer.eps=0.0 must be a finite number > 0"),
    ({"schedule.warmup_steps": -1}, r"schedule.warmup_steps=-1 must be an integer of at least 0"),
    ({"schedule.final_lr_ratio": -0.5}, r"schedule.final_lr_ratio=-0.5 must be in \[0, 1\]"),
    ({"peak_tflops": -1.0}, r"peak_tflops=-1.0 must be a finite number >= 0"),
    ({"precision.loss_scale": -1.0}, r"precision.loss_scale=-1.0 must be a finite number > 0"),
    ({"precision.loss_scale_growth": 0}, r"precision.loss_scale_growth=0 must be an integer of at least 1"),
    ({"pipeline.virtual_stages": 0}, r"pipeline.virtual_stages=0 must be an integer of at least 1"),
    ({"mesh.pipeline": 2, "pipeline.first_stage_layers": 1, "pipeline.last_stage_layers": 1,
      "optimizer.name": "muon", "optimizer.muon_iteration": "gathered"},
     r"optimizer.muon_iteration=gathered gathers each matrix split over pipeline by layer"),
    ({"model.kv_heads": -1}, r"model.kv_heads=-1 must be at least 0"),
    ({"model.global_every": -1, "model.sliding_window": 4}, r"model.global_every=-1 must be at least 1: every k-th "
                                                             r"layer is global"),
    ({"model.local_rope_theta": 100.0}, r"model.local_rope_theta=100.0 is the local layers' rotary base, but "
                                        r"model.global_every=0 makes no layer global"),
    ({"model.global_every": 2, "model.sliding_window": 4, "model.local_rope_theta": 100.0},
     r"model.local_rope_theta=100.0 must be a positive rotary base for a family with rotary positions"),
    ({"model.global_every": 2}, r"model.global_every=2 makes the other layers attend within model.sliding_window, "
     r"which is 0"),
    ({"model.global_every": 2, "model.sliding_window": 4, "moe.experts": 4},
     r"model.global_every=2 and moe.experts=4: layers that alternate windows and experts are not built"),
    ({"model.attention_scale_width": -1}, r"model.attention_scale_width=-1 must be at least 0"),
    ({"model.family": "llama", "mla.kv_rank": 16, "mla.rope_dim": 5, "mla.v_dim": 8},
     r"mla.kv_rank=16, mla.q_rank=0, mla.rope_dim=5 and mla.v_dim=8 do not describe latent attention with heads 16"),
    ({"mla.kv_rank": 16, "mla.rope_dim": 4, "mla.v_dim": 8},
     r"mla.kv_rank=16 with model.family='gpt2': latent attention replaces an attention of rotary positions"),
    ({"model.family": "llama", "mla.kv_rank": 16, "mla.rope_dim": 4, "mla.v_dim": 8, "model.sliding_window": 4},
     r"mla.kv_rank=16 with model.sliding_window=4, model.attention_scale_width=0 or model.kv_heads=0: latent"),
    ({"model.family": "llama", "mla.kv_rank": 12, "mla.rope_dim": 4, "mla.v_dim": 8, "sharding.zero": 3,
      "mesh.data": 8}, r"mla.kv_rank=12 is not divisible by mesh.data \(FSDP shards the latent axis\)=8"),
    ({"model.family": "gpt3"},
     r"model.family='gpt3' is unknown; use one of gpt2, llama, qwen2, qwen3, olmoe, gemma2, gemma3, deepseek3\."),
    ({"model.family": "llama", "model.rope_theta": 0.0}, r"model.rope_theta=0.0 must be a finite number > 0"),
    ({"model.family": "llama", "model.rope_type": "longrope"}, r"model.rope_type='longrope' is unknown; use one of "
     r"default, linear, llama3, yarn, dynamic\."),
    ({"model.family": "llama", "model.rope_type": "dynamic"}, r"model.rope_type='dynamic' needs rope_original_max_len "
     r"> 0, the context past which the rotary base grows; it is 0\."),
    ({"model.family": "llama", "model.rope_type": "yarn"}, r"model.rope_type='yarn' needs rope_original_max_len > 0, "
     r"rope_beta_slow < rope_beta_fast and rope_attention_factor >= 0; they are 0, 1.0, 32.0 and 0.0"),
    ({"model.rope_type": "linear"}, r"model.rope_type='linear' rescales rotary positions, which the gpt2 family "
     r"does not use"),
    ({"model.family": "llama", "model.rope_type": "linear", "model.rope_factor": 0.0},
     r"model.rope_factor=0.0 must be a finite number > 0"),
    ({"model.family": "llama", "model.rope_type": "llama3", "model.rope_factor": 8.0},
     r"model.rope_type='llama3' needs rope_original_max_len > 0 and 0 < rope_low_freq_factor < "
     r"rope_high_freq_factor; they are 0, 1.0 and 4.0"),
    ({"model.norm_eps": -1.0}, r"model.norm_eps=-1.0 must be a finite number >= 0 \(0: the family's own, "
     r"1e-05 for gpt2, 1e-06 for llama, 1e-06 for qwen2, 1e-06 for qwen3, 1e-06 for olmoe, 1e-06 for gemma2, "
     r"1e-06 for gemma3, 1e-06 for deepseek3\)"),
    ({"model.document_end": 256}, r"model.document_end=256 is not a token of the vocabulary of "
     r"model.vocab_size=256"),
    ({"moe.experts": 4, "moe.balance_weight": -1.0}, r"moe.balance_weight=-1.0 must be a finite number >= 0"),
    ({"moe.experts": 4, "moe.score": "relu"}, r"moe.score='relu' is unknown; use softmax"),
    ({"moe.experts": 8, "moe.groups": 3}, r"moe.groups=3 and moe.group_top_k=1 must split moe.experts=8 into equal"),
    ({"moe.experts": 8, "moe.top_k": 4, "moe.groups": 4}, r"moe.groups=4 and moe.group_top_k=1 must split moe.experts"),
    ({"moe.experts": 4, "moe.scale": 0.0}, r"moe.scale=0.0 must be a finite number > 0"),
    ({"model.family": "llama", "mla.kv_rank": 16, "mla.rope_dim": 4, "mla.v_dim": 8, "mla.score_scale": 0.0},
     r"mla.score_scale=0.0 must be a finite number > 0"),
    ({"moe.first_dense": 1}, r"moe.first_dense=1 and moe.dense_width=0 set the dense layers before the routed ones, "
                             r"but moe.experts=0 routes none"),
    ({"moe.experts": 4, "moe.first_dense": 2}, r"moe.first_dense=2 and moe.dense_width=0: the dense layers before "
                                               r"the routed ones must leave at least one of model.num_layers=2"),
    ({"model.mtp_depth": 32}, r"model.mtp_depth=32 must be a number of prediction modules from 1 to "
                              r"model.max_len - 1 = 31"),
    ({"model.mtp_depth": 1, "model.mtp_weight": 0.0}, r"model.mtp_weight=0.0 must be a finite weight > 0"),
    ({"model.mtp_depth": 1, "mesh.pipeline": 2, "mesh.data": 4},
     r"model.mtp_depth=1: the prediction modules read the last stage's output and the first stage's embedding"),
    ({"moe.experts": 4, "model.num_layers": 3, "moe.first_dense": 1, "mesh.pipeline": 2, "mesh.data": 4},
     r"moe.first_dense=1: the dense layers are a stack of their own, which meshlm's pipelines do not split"),
    ({"moe.experts": 4, "moe.bias_rate": 0.001}, r"moe.bias_rate=0.001 must be a finite number >= 0, and above 0 only "
                                                 r"with moe.router_bias=True"),
    ({"moe.experts": 4, "moe.router_bias": True, "moe.bias_rate": 0.001, "optimizer.name": "schedule_free_adamw",
      "schedule.decay": "constant"}, r"moe.bias_rate=0.001 moves each layer's router bias by its loads after the "
                                      r"optimizer's update, which schedule-free's"),
    ({"model.attention": "cudnn"}, r"model.attention='cudnn' needs an NVIDIA GPU, but this run's devices are cpu"),
    ({"sharding.fsdp_group": 4, "mesh.data": 8}, r"sharding.fsdp_group=4 shards ZeRO's state within groups, but "
     r"this run has sharding.zero=0"),
    ({"sharding.fsdp_group": 3, "sharding.zero": 3, "mesh.data": 8}, r"mesh.data=8 does not split into groups "
     r"of sharding.fsdp_group=3"),
    ({"sharding.fsdp_group": 2, "sharding.zero": 3, "mesh.data": 4, "mesh.expert": 2},
     r"sharding.fsdp_group=2 runs the ZeRO groups on the expert axis, so mesh.expert must be 1, got 2"),
    ({"sharding.fsdp_group": 4, "sharding.zero": 1, "mesh.data": 8, "moe.experts": 6},
     r"moe.experts=6 is not divisible by mesh.expert=4"),
]


@pytest.mark.parametrize("overrides,says", BAD, ids=[",".join(map(str, o.items())) for o, _ in BAD])
def test_bad_setting_is_refused_in_one_line_and_nothing_is_written(tmp_path, overrides, says):
  workdir = tmp_path / "run"
  config = tiny_config(**{"workdir": str(workdir), **overrides})
  with pytest.raises(ValueError, match=f"^{says}") as refused:
    train(config)
  assert "\n" not in str(refused.value)
  assert not workdir.exists()


def test_an_override_of_a_field_that_does_not_exist_is_refused():
  # A misspelt field would otherwise be a new one nothing reads, and the run would train the default.
  with pytest.raises(KeyError, match=r"model.scan_layer is not a config field; the fields of model are .*scan_layers"):
    tiny_config(**{"model.scan_layer": False})


def test_a_workdir_that_is_a_file_or_cannot_hold_files_is_refused(tmp_path):
  (tmp_path / "file").write_text("not a folder")
  with pytest.raises(ValueError, match="is a file, not a folder"):
    train(tiny_config(workdir=str(tmp_path / "file")))
  # /proc refuses every new file, even root's (who runs CI, and whom permission bits do not bind).
  with pytest.raises(ValueError, match=r"^workdir='/proc/meshlm/run' cannot be written \(/proc cannot hold "
                                       r"new files: .*\); choose another --config.workdir\.$"):
    train(tiny_config(workdir="/proc/meshlm/run"))
  check_run(tiny_config(workdir=str(tmp_path / "run")))
  assert os.listdir(tmp_path) == ["file"]  # the probe leaves nothing behind


def test_data_too_short_for_one_batch_is_refused_before_compiling(tmp_path):
  folder = tmp_path / "tokens"
  token_files.write_token_folder(folder, [np.arange(100) % 256], tokenizer="byte", vocab_size=256,
                                 val_fraction=0.0)  # an empty val.bin
  config = tiny_config(**{"workdir": str(tmp_path / "run"), "data.source": "tokens", "data.path": str(folder),
                          "eval_every": 5})
  with pytest.raises(ValueError, match=r"^The val split of .* holds 0 tokens, fewer than seq_len \+ 1 = 33"):
    train(config)
  config.model.max_len = 128
  with pytest.raises(ValueError, match=r"^The train split of .* holds 100 tokens, fewer than seq_len \+ 1 = 129"):
    train(config)
  assert not (tmp_path / "run").exists()
