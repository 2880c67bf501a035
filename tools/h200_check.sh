#!/usr/bin/env bash
# Issue 20's measurements (the bar issue 8 set) and issue 49's speed run on one H200, one stage per call;
# each prints a short table last.
#   here:   bash tools/h200_prepare.sh
#   device: run(command="bash tools/h200_check.sh speed", carry=[".peers", ".deps"], timeout_s=600)
#   CPU:    TINY=1 bash tools/h200_check.sh speed    (tests/test_gpu_script.py runs it so: two to three minutes)
# Stages (argument 1), each sized to end within the device tool's 600 s:
#   speed       issue 49's run, in this order so that a run cut short still answers the first question,
#               each part within what is left of $BUDGET_S (560 s): (a) `equal` with this commit's defaults;
#               (b) 124M at batch 32 one change at a time: each switch in $switches flipped from its default,
#               then each XLA preset that acts on one GPU; (c) 124M profiled through tools/trace_top.py and
#               the torch.compile peer under torch.profiler (tools/torch_profile.py), both summed per step;
#               (d) the 1B Llama compiled at the longest context the estimator fits in the card's memory
#               under model.remat=full_offload (tools/longest_offload.py). Ends with tools/speed_table.py's
#               table, one row per run, each part skipped or failed included. Expected: (a) 4-5 minutes,
#               (b) 2-3, (c) about 1.5, (d) about 1: one call, and if its table shows parts skipped, a
#               second with PARTS set to them (PARTS=cd runs only parts c and d).
#   equal       (default; the one that decided the bar) GPT-2 124M at batch 32 and 1.5B at batch 16, with
#               torch.compile and plain JAX at the same sizes and batches, in the same run
#   layers      as equal, ours twice: the layers scanned (model.scan_layers=true) and unrolled (false)
#   numerics    tools/gpu_numerics.py: cuDNN attention and fp8 matmuls against float32, with their times
#   best        124M from batch 64, doubling to 256 or until it no longer fits (32 is in `equal`)
#   best_xl     1.5B from batch 32, doubling to 128 or until it no longer fits
#   best_peers  both peers one doubling up (124M at 64, 1.5B at 32), beside ours there
#   flags       124M at batch 32 under each XLA flag preset (measure/bench_runs.py)
#   profile     a jax.profiler trace of 124M steps 2..4 into $OUT/profile-124m (TensorBoard or Perfetto), and
#               $OUT/trace_top.md: its kernel time by meshlm source line (tools/trace_top.py)
# TINY=1 runs equal, layers, flags, profile and speed on the CPU: GPT-2's tiny shape with the peers'
# vocabulary at batches 2 and 4 for the two sizes, sequence 64 (the peers' on a CPU), one timed step, no
# cuDNN, the tiny Llama in 0.05 GB for (d); PEERS= names the peers' folder (default .peers; none: skipped).
# Records go to $OUT/bench.jsonl (the device tool brings back at most 8 files of $OUT), and the tables are
# redrawn from them.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-equal}
case "$stage" in speed|equal|layers|numerics|best|best_xl|best_peers|flags|profile) ;;
  *) echo "error: unknown stage '$stage'; use speed, equal, layers, numerics, best, best_xl, best_peers, flags or profile." >&2
     exit 2 ;;
esac
tiny=${TINY:-}
case "$tiny:$stage" in :*|*:speed|*:equal|*:layers|*:flags|*:profile) ;;
  *) echo "error: TINY=1 runs the stages speed, equal, layers, flags and profile; '$stage' needs the GPU." >&2; exit 2 ;;
esac
out=${OUT:-/tmp/h200-check}
mkdir -p "$out"
export PYTHONPATH=".:.deps${PYTHONPATH:+:$PYTHONPATH}"
# JAX's default 75% leaves a quarter of the card to nobody; torch's caching allocator takes what it needs.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

if [ -n "$tiny" ]; then
  export JAX_PLATFORMS=cpu
  echo "TINY=1: the CPU" | tee "$out/card.txt"
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
fi
python3 -c "
import importlib, sys
versions = {}
for name in ['jax', 'jaxlib', 'flax', 'optax', 'orbax.checkpoint', 'ml_collections', 'torch']:
  try:
    versions[name] = getattr(importlib.import_module(name), '__version__', '?')
  except ImportError as error:
    versions[name] = f'missing ({error})'
print('python', sys.version.split()[0], versions)" | tee "$out/versions.txt"
git log -1 --format='commit %H %cI' 2>/dev/null | tee "$out/commit.txt"
peers_dir=${PEERS-.peers}
[ -d "$peers_dir" ] || echo "warning: no peers folder '$peers_dir' (run tools/h200_prepare.sh here and carry .peers); peers will be skipped"

if [ -n "$tiny" ]; then
  small=--config=configs/gpt2.py:tiny,model.vocab_size=50257,batch_size=2
  large=--config=configs/gpt2.py:tiny,model.vocab_size=50257,batch_size=4
  common=(--seq_len=64 --steps=1 --warmup=0 --windows=1 --timeout=300 --out="$out/bench.jsonl")
  llama=(--spec=configs/llama.py:tiny,model.remat=full_offload --limit_gb=0.05)
  torch_size=tiny:2
else
  small=--config=configs/gpt2.py:124m,batch_size=32
  large=--config=configs/gpt2.py:1558m,batch_size=16
  common=(--config.model.attention=cudnn --timeout=300 --out="$out/bench.jsonl")
  llama=()  # tools/longest_offload.py's default: the 1B Llama in what jax gives the card
  torch_size=124m:32
fi
peers=(); [ -d "$peers_dir" ] && peers=(--peers="$peers_dir")
# The speed stage's (b): true/false fields of the model each measured flipped from its default, one at a time.
switches=(model.scan_layers model.recompute_activation)
# The device tool stops a command at 600 s; stopping the stage a little earlier leaves time for the table.
bench=(timeout "${BUDGET_S:-540}" python3 tools/bench.py)

profile_commands() {  # profile_commands DIR: the run that traces $small's steps 2..4 into DIR, XLA's dump of its
  # optimized step beside (which names each kernel's source lines), and tools/trace_top.py's table joining the two
  profile_run=(env XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$1/hlo --xla_dump_hlo_module_re=.*train_step.*"
               python3 tools/bench.py "$small" --windows=1 --config.profile_steps=2,4 --config.workdir="$1/profile-124m"
               "${common[@]}")
  profile_table=(python3 tools/trace_top.py --trace="$1/profile-124m/profile" --hlo="$1/hlo" --steps=3)
}

note() {  # note KIND PART WHAT WHY: a line of bench.jsonl that tools/speed_table.py shows as a row
  python3 -c 'import json, sys; print(json.dumps(dict(zip(("kind", "part", "what", "why"), sys.argv[1:]))))' \
    "$@" >> "$out/bench.jsonl"
}

part() {  # part PART WHAT COMMAND...: the command within what is left of the budget, unless PARTS leaves PART out
  [[ ${PARTS:-abcd} == *"$1"* ]] || return 0
  local name=$1 what=$2 left=$((deadline - SECONDS)) status
  shift 2
  if [ "$left" -lt 10 ]; then note skipped "$name" "$what" "$left s of the budget left"; return 0; fi
  timeout "$left" "$@" 2> "$scratch/err"
  status=$?
  cat "$scratch/err" >&2
  if [ "$status" -eq 124 ]; then note failed "$name" "$what" "stopped at the end of the budget"
  elif [ "$status" -ne 0 ]; then note failed "$name" "$what" "$(grep -v '^[[:space:]]*$' "$scratch/err" | tail -n 1)"; fi
  return 0
}

speed() {
  deadline=$((SECONDS + ${BUDGET_S:-560}))
  scratch=$(mktemp -d)  # traces and XLA's dumps: more files than the 8 of $OUT that come back
  trap 'rm -rf "$scratch"' EXIT
  part a equal python3 tools/bench.py "$small" "$large" "${common[@]}" "${peers[@]}"
  local flipped
  read -r -a flipped <<< "$(python3 -c 'import sys; from measure.bench_runs import switched
print(*switched(sys.argv[1], sys.argv[2:]))' "${small#--config=}" "${switches[@]}")"
  if [ ${#flipped[@]} -eq 0 ]; then note failed b switches "could not flip ${switches[*]} (see speed.err)"
  else part b switches python3 tools/bench.py "${flipped[@]/#/--config=}" "${common[@]}"; fi
  part b presets python3 tools/bench.py "$small" --xla_presets=cudnn_ln,lt,dus0,dsf,noremat "${common[@]}"
  # The tables go to this stage's log, where tools/speed_table.py reads each one's total.
  profile_commands "$scratch"
  part c "meshlm profile" "${profile_run[@]}" --out="$scratch/bench.jsonl"
  [ -d "$scratch/profile-124m/profile" ] && part c "meshlm profile table" "${profile_table[@]}"
  part c "torch.compile profile" python3 tools/torch_profile.py "$peers_dir/torch_gpt2.py" "$torch_size" \
    "$scratch/torch_trace.json.gz"
  [ -s "$scratch/torch_trace.json.gz" ] &&
    part c "torch.compile profile table" python3 tools/trace_top.py --trace="$scratch/torch_trace.json.gz" --steps=3
  part d "longest full_offload context" python3 tools/longest_offload.py "${llama[@]}" --out="$out/bench.jsonl"
}

case "$stage" in
  equal) "${bench[@]}" "$small" "$large" "${common[@]}" "${peers[@]}" ;;
  layers) "${bench[@]}" "$small" "$small,model.scan_layers=false" "$large" "$large,model.scan_layers=false" \
            "${common[@]}" "${peers[@]}" ;;
  numerics) timeout "${BUDGET_S:-540}" python3 tools/gpu_numerics.py | tee "$out/numerics.md" ;;
  best) "${bench[@]}" --config=configs/gpt2.py:124m --batch=64 --max_batch=256 --best_batch --windows=2 "${common[@]}" ;;
  best_xl) "${bench[@]}" --config=configs/gpt2.py:1558m --batch=32 --max_batch=128 --best_batch --windows=2 "${common[@]}" ;;
  best_peers) "${bench[@]}" --config=configs/gpt2.py:124m,batch_size=64 --config=configs/gpt2.py:1558m,batch_size=32 \
                --windows=2 "${common[@]}" "${peers[@]}" ;;
  flags) "${bench[@]}" "$small" --xla_presets=default,lhs,cublas,cudnn_ln,lt,dus0,dsf,noremat --windows=2 \
           "${common[@]}" ;;
  profile) profile_commands "$out"
           timeout "${BUDGET_S:-540}" "${profile_run[@]}" && "${profile_table[@]}" | tee "$out/trace_top.md" ;;
  speed) speed ;;
esac > "$out/$stage.log" 2> "$out/$stage.err"
echo "exit status $? (log: $out/$stage.log, $out/$stage.err)"
tail -n 5 "$out/$stage.err"
if [ -s "$out/bench.jsonl" ]; then python3 tools/bench.py --report="$out/bench.jsonl"; else echo "no measurements"; fi
if [ "$stage" = speed ]; then python3 tools/speed_table.py --out="$out"; fi
