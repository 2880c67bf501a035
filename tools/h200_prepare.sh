#!/usr/bin/env bash
# Before tools/h200_check.sh: gather, next to the code, what the GPU machine lacks and cannot download.
#   .peers/  the peer scripts (../shared/peers), run by tools/bench.py --peers=.peers
#   .deps/   ml_collections (pure Python): the image has jax, flax, optax, orbax and torch, not it
# Both are git-ignored; the device tool carries them with carry=[".peers", ".deps"].
set -euo pipefail
cd "$(dirname "$0")/.."
peers=${1:-../shared/peers}  # relative to the repository root, where this script runs
rm -rf .peers .deps && mkdir -p .peers .deps
cp "$peers"/torch_gpt2.py "$peers"/jax_gpt2.py .peers/
cp -r "$(.venv/bin/python -c 'import ml_collections, os; print(os.path.dirname(ml_collections.__file__))')" .deps/
du -sh .peers .deps
