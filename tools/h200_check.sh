#!/usr/bin/env bash
# Issue 20's measurements (the bar issue 8 set) on one H200, one stage per call; each prints a short table last.
#   here:   bash tools/h200_prepare.sh
#   device: run(command="bash tools/h200_check.sh", carry=[".peers", ".deps"], timeout_s=600)
# Stages (argument 1), each sized to end within the device tool's 600 s:
#   equal       (default; the one that decides the bar) GPT-2 124M at batch 32 and 1.5B at batch 16, with
#               torch.compile and plain JAX at the same sizes and batches, in the same run
#   layers      as equal, ours twice: the layers scanned (model.scan_layers=true) and unrolled (false)
#   numerics    tools/gpu_numerics.py: cuDNN attention and fp8 matmuls against float32, with their times
#   best        124M from batch 64, doubling to 256 or until it no longer fits (32 is in `equal`)
#   best_xl     1.5B from batch 32, doubling to 128 or until it no longer fits
#   best_peers  both peers one doubling up (124M at 64, 1.5B at 32), beside ours there
#   flags       124M at batch 32 under each XLA flag preset (tools/bench_runs.py)
#   profile     a jax.profiler trace of 124M steps 2..4 into $OUT/profile-124m (TensorBoard or Perfetto), and
#               $OUT/trace_top.md: its kernel time by meshlm source line (tools/trace_top.py)
# Records go to $OUT/bench.jsonl (the device tool brings $OUT back), and the table is redrawn from them.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-equal}
case "$stage" in equal|layers|numerics|best|best_xl|best_peers|flags|profile) ;;
  *) echo "error: unknown stage '$stage'; use equal, layers, numerics, best, best_xl, best_peers, flags or profile." >&2; exit 2 ;;
esac
out=${OUT:-/tmp/h200-check}
mkdir -p "$out"
export PYTHONPATH=".:.deps${PYTHONPATH:+:$PYTHONPATH}"
# JAX's default 75% leaves a quarter of the card to nobody; torch's caching allocator takes what it needs.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
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
[ -d .peers ] || echo "warning: no .peers/ (run tools/h200_prepare.sh here and carry it); peers will be skipped"

small=--config=configs/gpt2.py:124m,batch_size=32
large=--config=configs/gpt2.py:1558m,batch_size=16
common=(--config.model.attention=cudnn --timeout=300 --out="$out/bench.jsonl")
peers=(); [ -d .peers ] && peers=(--peers=.peers)
# The device tool stops a command at 600 s; stopping the stage a little earlier leaves time for the table.
bench=(timeout "${BUDGET_S:-540}" python3 tools/bench.py)
case "$stage" in
  equal) "${bench[@]}" "$small" "$large" "${common[@]}" "${peers[@]}" ;;
  layers) "${bench[@]}" "$small" "$small,model.scan_layers=false" "$large" "$large,model.scan_layers=false" \
            "${common[@]}" "${peers[@]}" ;;
  numerics) timeout "${BUDGET_S:-540}" python3 tools/gpu_numerics.py | tee "$out/numerics.md" ;;
  best) "${bench[@]}" --config=configs/gpt2.py:124m --batch=64 --max_batch=256 --best_batch --windows=2 "${common[@]}" ;;
  best_xl) "${bench[@]}" --config=configs/gpt2.py:1558m --batch=32 --max_batch=128 --best_batch --windows=2 "${common[@]}" ;;
  best_peers) "${bench[@]}" --config=configs/gpt2.py:124m,batch_size=64 --config=configs/gpt2.py:1558m,batch_size=32 \
                --windows=2 "${common[@]}" "${peers[@]}" ;;
  flags) "${bench[@]}" "$small" --xla_presets=default,lhs,cublas,combined --windows=2 "${common[@]}" ;;
  # XLA's dump of the optimized step names each kernel's source lines: tools/trace_top.py joins it to the trace.
  profile) XLA_FLAGS="--xla_dump_to=$out/hlo --xla_dump_hlo_module_re=.*train_step.*" "${bench[@]}" "$small" \
             --windows=1 --config.profile_steps=2,4 --config.workdir="$out/profile-124m" "${common[@]}" &&
           python3 tools/trace_top.py --trace="$out/profile-124m/profile" --hlo="$out/hlo" --steps=3 \
             | tee "$out/trace_top.md" ;;
esac > "$out/$stage.log" 2> "$out/$stage.err"
echo "exit status $? (log: $out/$stage.log, $out/$stage.err)"
tail -n 5 "$out/$stage.err"
if [ -s "$out/bench.jsonl" ]; then python3 tools/bench.py --report="$out/bench.jsonl"; else echo "no measurements"; fi
