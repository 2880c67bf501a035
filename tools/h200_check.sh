#!/usr/bin/env bash
# Issue 8's measurements on one H200, one stage per call; each prints a short table last.
#   here:   bash tools/h200_prepare.sh
#   device: run(command="bash tools/h200_check.sh", carry=[".peers", ".deps"], timeout_s=600)
# Stages (argument 1):
#   equal    (default) GPT-2 124M at batch 32 and 1.5B at batch 16, torch.compile and plain JAX in the same run
#   best     the largest batch that fits, doubling from 32 and 16, ours and both peers
#   flags    the XLA flag presets (tools/bench_runs.py) on both sizes, no peers
#   profile  a jax.profiler trace of 124M steps 2..4 into $OUT/profile-124m (TensorBoard or Perfetto)
# Records go to $OUT/bench.jsonl (the device tool brings $OUT back), and the table is redrawn from them.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-equal}
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

sizes=(--config=configs/gpt2.py:124m,batch_size=32 --config=configs/gpt2.py:1558m,batch_size=16)
common=(--config.model.attention=cudnn --timeout=300 --out="$out/bench.jsonl")
peers=(); [ -d .peers ] && peers=(--peers=.peers)
case "$stage" in
  equal) python3 tools/bench.py "${sizes[@]}" "${common[@]}" "${peers[@]}" ;;
  best) python3 tools/bench.py "${sizes[@]}" "${common[@]}" "${peers[@]}" --best_batch --max_batch=256 --windows=2 ;;
  flags) python3 tools/bench.py "${sizes[@]}" "${common[@]}" --xla_presets=default,lhs,cublas,combined --windows=2 ;;
  profile) python3 tools/bench.py --config=configs/gpt2.py:124m,batch_size=32 "${common[@]}" --windows=1 \
             --config.profile_steps=2,4 --config.workdir="$out/profile-124m" ;;
  *) echo "error: unknown stage '$stage'; use equal, best, flags or profile." >&2; exit 2 ;;
esac > "$out/$stage.log" 2> "$out/$stage.err"
echo "exit status $? (log: $out/$stage.log, $out/$stage.err)"
tail -n 5 "$out/$stage.err"
python3 tools/bench.py --report="$out/bench.jsonl"
