"""Every field any part of meshlm reads, with its default.

Family files (gpt2.py, ...) start from `base()` and change fields; the command
line changes them again with `--config.<field>=<value>`. The config is locked,
so a misspelt field is an error, never a silently ignored setting.
"""

import ml_collections


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # Empty: train.py names it from the command (run/run_name.py), runs/<config>-<variant>[-<digest of
  # the overrides>], so the same command resumes its run and another command starts its own.
  c.workdir = ""
  c.steps = 300
  c.batch_size = 32  # global batch, in sequences, summed over all devices
  c.grad_accum = 1  # micro-batches per step, accumulated inside the compiled step
  # "STEP:field=value[,field=value];STEP:...": the first steps at a smaller batch_size, model.max_len or
  # model.sliding_window, each entry's until its STEP, the config's own from the last STEP on; each phase's step
  # compiled ahead (training/curriculum.py; modded-nanogpt's window and batch warmups). Empty: the config's own.
  c.curriculum = ""
  c.log_every = 10
  c.eval_every = 100
  c.eval_batches = 4
  c.sample_tokens = 120  # length of the closing text sample; 0 skips it
  c.sample_prompt = "def "
  c.peak_tflops = 0.0  # per device, for MFU; 0 looks the device kind up
  c.resume = "auto"  # auto: from the workdir's latest checkpoint | never | a step number
  c.nonfinite = "skip"  # a non-finite loss or gradient: skip the update and count it | stop
  # What decides that a step is finite. scalars: its loss, gradient norm and learning rate, which bound an
  # Adam or SGD update short of float32's range (a learning rate near 3.4e38 can still overflow the
  # weights), at no cost | full: also every new weight and moment, a further pass over the state (muon
  # and schedule_free_adamw always take it)
  c.nonfinite_check = "scalars"
  # hf:<directory>: start from a Hugging Face GPT-2 or Llama checkpoint (config.json + safetensors),
  # whose config.json sets the model fields; empty: random initialisation.
  c.init_from = ""
  # "<workdir>:<step>": start from another run's whole state (weights, optimizer, step) at that checkpoint,
  # which is left as it is: e.g. a WSD decay from a stable run, into a workdir of its own
  c.branch_from = ""
  # "FIRST,LAST": a jax.profiler trace of steps FIRST..LAST (1-based, inclusive, as logged) into
  # <workdir>/profile, for TensorBoard's profile plugin or ui.perfetto.dev; empty: no trace
  c.profile_steps = ""

  # Weights & Biases (the `wandb` extra): the same scalars as metrics.jsonl, the config and the git
  # commit. Off while project is ""; WANDB_MODE=offline keeps a run on disk until `wandb sync`.
  c.wandb = ml_collections.ConfigDict()
  c.wandb.project = ""
  c.wandb.group = ""  # runs that belong together (tools/sweep.py sets the recipe's name)

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 100  # steps between async saves (0: none); the last step is always saved
  c.checkpoint.keep = 3  # the newest k are kept

  c.distributed = ml_collections.ConfigDict()
  c.distributed.initialize = "auto"  # auto: when TPU pod or SLURM variables say so | yes | no
  c.distributed.coordinator = ""  # host:port of process 0; empty lets jax detect it
  c.distributed.num_processes = 0  # 0: detect
  c.distributed.process_id = -1  # -1: detect
  # Seconds without a heartbeat before a process counts as dead; under fault_tolerance=survive a
  # CPU collective waits three times as long for a late peer (parallel/distributed.py).
  c.distributed.heartbeat_seconds = 100

  # none: a lost process ends the run, and a restart resumes from the last checkpoint |
  # survive: the other processes drop it, rebuild the mesh over the live devices and redo the step
  # from the state in memory (layouts where every shard has a copy on another process; docs/checkpoints.md)
  c.fault_tolerance = "none"
  # survive: every K steps, copy the shards that only one process holds (ZeRO, tensor or pipeline
  # across processes) into another process's host memory; a lost process then costs at most K
  # steps redone (0: none; docs/checkpoints.md)
  c.peer_copy_every = 0

  c.model = ml_collections.ConfigDict()
  c.model.family = "gpt2"  # a family registered in model/families.py
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.embed_dim = 128
  c.model.mlp_dim = 512
  c.model.max_len = 128  # the training sequence length; also gpt2's learned positions, unless positions says
  c.model.positions = 0  # gpt2: learned position rows, at least max_len (a curriculum's shorter phases); 0: max_len
  c.model.vocab_size = 256  # padded to a multiple of 128 inside the model
  c.model.remat = "none"  # none | full | full_offload | save_dots | save_attention | offload
  # True: the stacked blocks run in one nnx.scan (compile time flat in depth). False: a Python loop over
  # the layers (compile time grows with depth), as MaxText's scan_layers=False.
  c.model.scan_layers = True
  # True: the MLP keeps only its activation's input (SwiGLU's gate and up) for the backward pass, which
  # makes GELU / SiLU, their derivative and the down projection's input again (model/layers.py
  # activated_down): a bf16 GPT-2 124M layer keeps 12.04 D-units per token, not 28.04 (docs/memory.md).
  # False: autodiff as written, kept as the reference the gradients are tested against and as a switch for
  # GPU timings, where the recomputation's cost is not measured yet.
  c.model.recompute_activation = True
  # the attention kernel: xla (blockwise, any backend) | cudnn (GPU) | splash (TPU; interpreted elsewhere)
  # | auto (cudnn or splash where they apply, else xla)
  c.model.attention = "auto"
  c.model.attention_block = 512  # xla attention: positions per query/key block; memory is linear in T
  c.model.sliding_window = 0  # W > 0: each query sees the W latest positions up to its own (Mistral); 0: all
  c.model.attention_softcap = 0.0  # C > 0: attention scores s soft-capped to C tanh(s / C) (Gemma 2: 50.0); 0: off
  c.model.activation = ""  # the MLP's: "" the family's own (gpt2 gelu, llama silu) | gelu | silu | relu2 (ReLU^2)
  c.model.zero_init_out = False  # True: attention output and MLP down projections start at zero (modded-nanogpt)
  c.model.unet_skips = False  # True: the stack's second half adds the first half's outputs back, U-net fashion
  c.model.value_embeds = 0  # k > 0: k token tables mixed into the values of the first and last k layers; 0: off
  c.model.qk_norm = False  # True: each query and key head RMS-normalised before attention (modded-nanogpt, Qwen3)
  c.model.fp8_head = False  # True: the head's matmul in fp8 (E4M3, gradient E5M2) at fixed scales (modded-nanogpt)
  c.model.logit_softcap = 0.0  # C > 0: output logits z soft-capped to C tanh(z / C) (Gemma 2: 30.0); 0: off
  # D > 0: D multi-token prediction modules after the stack, the k-th predicting token i+k+1 (DeepSeek-V3: 1);
  # their mean cross-entropy joins the objective at mtp_weight (DeepSeek-V3: 0.3); 0: next token only
  c.model.mtp_depth = 0
  c.model.mtp_weight = 0.3
  c.model.global_every = 0  # k > 0: every k-th layer global, the rest within sliding_window (Gemma 2: 2); 0: all alike
  c.model.local_rope_theta = 0.0  # with global_every: the local layers' rotary base, unscaled (Gemma 3: 10000)
  c.model.attention_scale_width = 0  # scores scaled by 1/sqrt(this) (Gemma 2's query_pre_attn_scalar); 0: head width
  c.model.loss_chunk = 4096  # tokens per device in one chunk of the head and loss: logits exist chunk by chunk
  c.model.mlp_chunk = 0  # tokens per device in one chunk of the MLP, recomputed in backward (long contexts); 0: off
  c.model.document_end = -1  # token that ends a packed document, attention stops there; data.segments sets it
  c.model.kv_heads = 0  # llama: key/value heads for grouped-query attention; 0 = num_heads
  c.model.head_width = 0  # each attention head's width; 0 = embed_dim // num_heads (Qwen3 sets 128)
  c.model.rope_theta = 10000.0  # llama: rotary base
  # llama: rotary frequencies rescaled for a longer context, as Llama 3.1's checkpoints set them
  # (model/rotary.py rotary_frequencies): default | linear (every frequency / rope_factor) | llama3 | yarn | dynamic
  c.model.rope_type = "default"
  c.model.rope_factor = 1.0
  c.model.rope_low_freq_factor = 1.0
  c.model.rope_high_freq_factor = 4.0
  c.model.rope_original_max_len = 0
  c.model.rope_beta_fast = 32.0  # yarn: the ramp between pairs kept and pairs divided by rope_factor
  c.model.rope_beta_slow = 1.0
  c.model.rope_attention_factor = 0.0  # yarn: cos and sin scaled by it; 0: 0.1 ln(rope_factor) + 1
  c.model.rope_truncate = True
  c.model.norm_eps = 0.0  # LayerNorm / RMSNorm epsilon; 0: the family's own (gpt2 1e-5, llama 1e-6)

  c.moe = ml_collections.ConfigDict()
  c.moe.experts = 0  # E: 0 keeps every feed-forward layer dense
  c.moe.every = 1  # every k-th layer's feed-forward is a mixture of experts (1: all, 2: alternate)
  c.moe.first_dense = 0  # the first k layers dense before the routed ones, a stack of their own (DeepSeek-V3: 3)
  c.moe.dense_width = 0  # their MLP's width (DeepSeek-V3: 18432); 0: model.mlp_dim
  c.moe.top_k = 2  # experts per token
  c.moe.shared_width = 0  # F_s > 0: a shared SwiGLU expert every token takes, sigmoid-gated (Qwen2-MoE)
  c.moe.renormalize = True  # the top-k router weights scaled to sum to one (Mixtral); False: the softmax's (OLMoE)
  c.moe.capacity_factor = 1.25  # slots per expert = factor x k x tokens / E per sequence; overflow is dropped
  c.moe.dropless = False  # True: no drops; grouped matmuls (ragged_dot), or T slots under mesh.expert
  c.moe.balance_weight = 0.01  # alpha in alpha * E * sum_i f_i P_i (Switch Transformer)
  c.moe.z_weight = 0.001  # router z-loss: mean squared log-sum-exp of the router logits (ST-MoE)
  # DeepSeek-V3's routing (model/moe.py route):
  c.moe.score = "softmax"  # softmax: one distribution over the experts | sigmoid: each expert scored apart
  c.moe.groups = 1  # experts in this many equal groups; a token chooses within its group_top_k best (1: no groups)
  c.moe.group_top_k = 1
  c.moe.scale = 1.0  # the routed experts' combined output times this (DeepSeek-V3: 2.5)
  c.moe.shared_gate = True  # the shared expert behind a learned sigmoid gate (Qwen2-MoE); False: added as is
  # a per-expert bias added to the scores for the choice only (DeepSeek-V3's e_score_correction_bias), moved after
  # each step by bias_rate against its expert's load error: balance without an auxiliary loss (0: left as it is)
  c.moe.router_bias = False
  c.moe.bias_rate = 0.0

  # multi-head latent attention (model/mla.py; DeepSeek-V2/V3) where kv_rank > 0: keys and values from a latent
  # kv_rank wide (the KV cache keeps it and the rotary key only), a rotary key of rope_dim shared by the heads
  # (model.head_width = the no-position part + rope_dim), values v_dim wide, queries through a q_rank latent
  c.mla = ml_collections.ConfigDict()
  c.mla.kv_rank = 0  # 0: ordinary (grouped-query) attention
  c.mla.q_rank = 0  # 0: queries projected from the input directly (DeepSeek-V2-Lite)
  c.mla.rope_dim = 0
  c.mla.v_dim = 0
  c.mla.score_scale = 1.0  # scores times this beyond 1/sqrt(head_width): DeepSeek's YaRN (0.1 m ln factor + 1)^2

  c.attention = ml_collections.ConfigDict()
  c.attention.context = "allgather"  # over a sharded `length`: allgather | ring | ulysses

  c.precision = ml_collections.ConfigDict()
  # Matmul and activation dtype: float32 | bfloat16 | float16 (with dynamic loss scaling) | float8
  # (weight matmuls in fp8, E4M3 forward and E5M2 gradients, between bfloat16 activations).
  # Master weights, norms, softmax and the loss stay float32 whatever this says.
  c.precision.compute = "bfloat16"
  c.precision.moments = "float32"  # Adam's m and v as stored: float32 | bfloat16 (their arithmetic stays float32)
  c.precision.loss_scale = 2.0**15  # float16: the starting loss scale
  c.precision.loss_scale_growth = 1000  # float16: finite steps in a row before the scale doubles

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1: the devices the other axes leave over
  c.mesh.pipeline = 1
  c.mesh.expert = 1
  c.mesh.sequence = 1
  c.mesh.tensor = 1
  # Two network tiers: how many slices (TPU) or hosts (GPU) each axis spans, of its size above; the
  # axis's devices inside one are neighbours on the fast links (ICI, NVLink). Only data and pipeline
  # may cross the slow tier (DCN, InfiniBand); the other three are refused if set above 1.
  c.mesh.dcn_data = 1
  c.mesh.dcn_pipeline = 1
  c.mesh.dcn_expert = 1
  c.mesh.dcn_sequence = 1
  c.mesh.dcn_tensor = 1

  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.schedule = "gpipe"  # gpipe | 1f1b | interleaved; used when mesh.pipeline > 1
  c.pipeline.microbatches = 4  # M: bubble/total is (P - 1) / (M + P - 1), bubble/ideal (P - 1) / M
  c.pipeline.virtual_stages = 2  # V: layer chunks per device for `interleaved`
  # Layers of the first and last chunks (virtual stages), the chunks between splitting the rest equally, for
  # layer counts that do not divide (Llama 3 405B: 126 over 16 stages as 7, 8 x 14, 7); 0 and 0: equal chunks
  c.pipeline.first_stage_layers = 0
  c.pipeline.last_stage_layers = 0

  c.sharding = ml_collections.ConfigDict()
  c.sharding.zero = 0  # 0: replicated; 1: optimizer state over data; 3: params too (FSDP)
  # HSDP: ZeRO within groups of this many data devices (run on the expert axis), replicas across groups;
  # 0: ZeRO over all of data
  c.sharding.fsdp_group = 0

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"  # adamw | adam | adam_l2 | sgd | momentum | muon | schedule_free_adamw
  c.optimizer.lr = 1e-3
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 0.1
  c.optimizer.decay_embeddings = False
  c.optimizer.decay_1d = False  # biases (whatever their rank) and norm scales
  c.optimizer.clip_norm = 1.0  # global-norm clipping; 0 turns it off
  # muon (training/muon.py): the layers' matrices by orthogonalised momentum, everything else by adamw above
  c.optimizer.muon_momentum = 0.95  # Nesterov momentum's decay
  c.optimizer.muon_steps = 5  # Newton-Schulz iterations
  c.optimizer.muon_rms = 0.2  # the update's RMS, AdamW's (Liu et al. 2025)
  # how a matrix split over devices is orthogonalised: round_robin | gathered | partitioned (training/muon.py)
  c.optimizer.muon_iteration = "round_robin"

  # muP (model/mup.py): a width W parametrised against a base width, so that its learning rate is the base's
  c.mup = ml_collections.ConfigDict()
  c.mup.base_width = 0  # 0: the standard parametrisation; else a divisor of model.embed_dim in whole heads

  c.schedule = ml_collections.ConfigDict()
  c.schedule.warmup_steps = 30
  # cosine | constant | wsd (warmup-stable-decay: the peak rate until the last decay_steps, then linearly to
  # final_lr_ratio x lr; a stable run's checkpoint decays into any shorter budget: branch_from)
  c.schedule.decay = "cosine"
  c.schedule.final_lr_ratio = 0.1
  c.schedule.decay_steps = 0  # wsd: the final decay's steps

  # lm: next-token cross-entropy (on completions' tokens where the data masks them) | dpo: preference pairs
  # (tools/prepare.py --chosen_field/--rejected_field), the policy against the weights it started from | grpo:
  # completions the policy samples for prompts, scored by a reward
  c.objective = "lm"
  c.dpo = ml_collections.ConfigDict()
  c.dpo.loss = "sigmoid"  # sigmoid (DPO) | robust (label_smoothing) | ipo | simpo (no reference)
  c.dpo.beta = 0.1  # how far the policy may move from the reference: the log-ratio's scale
  c.dpo.label_smoothing = 0.0  # robust: the assumed rate of flipped preferences, in [0, 0.5)
  c.dpo.gamma = 0.5  # simpo: the reward margin the chosen answer must clear
  c.dpo.sft_weight = 0.0  # > 0: plus this times the chosen answers' mean negative log-likelihood per token (RPO)
  c.grpo = ml_collections.ConfigDict()  # training/grpo.py, training/rollouts.py
  c.grpo.prompts = ""  # a JSON-lines file of records with a prompt and the answer a reward checks
  c.grpo.eval_prompts = ""  # another such file: eval_every scores greedy answers to its prompts (eval reward)
  c.grpo.prompt_field = "prompt"
  c.grpo.answer_field = "answer"
  c.grpo.group = 4  # completions sampled per prompt; batch_size / group prompts a step
  c.grpo.max_new_tokens = 8  # each completion's length at most, its stop token included
  c.grpo.temperature = 1.0
  c.grpo.top_k = 0  # 0 keeps the whole vocabulary
  c.grpo.top_p = 1.0
  c.grpo.stop = "\n"  # a comma list of texts of one token each that end a completion, beside end-of-text
  c.grpo.reward = "exact_match"  # a comma list, summed: exact_match | format:REGEX | module:function
  c.grpo.scale_rewards = "group"  # group | batch | none: what the advantages are divided by the deviation of
  c.grpo.loss = "dapo"  # dapo (over the batch's tokens) | grpo (per completion, then mean) | dr_grpo (a constant)
  c.grpo.beta = 0.0  # > 0: plus beta x the k3 estimate of the KL divergence from the weights the run started from

  # LoRA (training/lora.py): rank > 0 trains low-rank adapters on the targeted projections, every weight frozen
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0
  c.lora.alpha = 16.0  # the adapters' product is scaled by alpha / rank
  c.lora.targets = "attention"  # a comma list of attention, mlp, or kernels: qkv, q, k, v, out, up, gate, down
  c.lora.frozen_dtype = "float32"  # bfloat16 stores the frozen matrices in half the bytes

  c.data = ml_collections.ConfigDict()
  c.data.source = "builtin"  # builtin | tokens | synthetic
  c.data.seed = -1  # the batches' order (input_pipeline/data.py data_seed); -1: `seed`, which also draws the weights
  c.data.path = ""  # for `tokens`: a folder written by tools/prepare.py
  c.data.segments = False  # packed documents: attention stops at the tokenizer's end-of-text (model.document_end)
  c.data.prefetch = 2  # batches built ahead on a background thread
  return c
