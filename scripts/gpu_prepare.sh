#!/usr/bin/env bash
# Prepares a GPU check for a machine with no package index (scripts/gpu_check.sh runs it there), in .gpu/ (git
# ignores it; copy it beside the checkout): wheels of what a CUDA PyTorch image commonly lacks (the grammar engine,
# RE2; Python 3.12, manylinux x86-64), and the trees the GPU figures are compared with, as git archives: the tree
# of the last GPU run (docs/benchmarks.md section 9) and the slot KV cache's (benchmarks.paged_decode --baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
LAST_GPU_RUN=48d91b0   # the H200 run's tree (its base decode: 1921 / 7163 / 13307 tok/s at batch 8 / 32 / 64)
SLOT_CACHE=81cbf2a     # the last tree with the slot KV cache
grep -qsx "/.gpu/" .git/info/exclude || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/trees/last-gpu-run .gpu/trees/slot-cache
platforms=()
for n in 2_31 2_28 2_27 2_24 2_17 2014 1; do
  case $n in 2014|1) platforms+=(--platform "manylinux${n}_x86_64");; *) platforms+=(--platform "manylinux_${n}_x86_64");; esac
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .gpu/whl llguidance==1.9.1 google-re2==1.1.20251105 gguf==0.19.0
git archive "$LAST_GPU_RUN" | tar -x -C .gpu/trees/last-gpu-run
git archive "$SLOT_CACHE" | tar -x -C .gpu/trees/slot-cache
du -sh .gpu
