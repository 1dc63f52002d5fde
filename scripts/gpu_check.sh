#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md section 9, from the repository root on a CUDA machine whose python3 has
# PyTorch, transformers and peft (a CUDA image), with .gpu/ from scripts/gpu_prepare.sh beside the code:
#
#   scripts/gpu_check.sh STAGE [LOG_DIR]      STAGE: tests | bench | paged | trace | all
#
# tests: tests/test_cuda.py and tests/test_cuda_quantized.py (4 workers; the CPU half of padded_decode left out).
# bench: a compiled layer's kernels per LoRA kernel (benchmarks.lora_kernel_count), then decode and prefill per
#        LoRA kernel (masked, the CUDA default; stacked; gathered) and quantized weights,
#        then the last GPU run's tree, base and masked, in the same call (its base is the bar for this one's).
# paged: the paged KV cache's decode step against the slot cache's tree (benchmarks.paged_decode).
# trace: where a batch-8 decode step's GPU time goes, masked against stacked, by kernel family (benchmarks.cuda_profile).
# Each stage ends within its own timeout and writes its log to LOG_DIR (default /tmp/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?STAGE: tests, bench, paged, trace or all}
logs=${2:-/tmp/gpu-check}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/gpu-inductor
if ! python3 -c "import llguidance, re2, gguf" 2>/dev/null; then  # (the wheels, where the image lacks them)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site \
    .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/gpu-site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$logs/gpu.txt"

run_tests() {
  timeout 330 python3 -m pytest -v -n 4 --dist load -p no:cacheprovider -k "not padded_decode" \
    tests/test_cuda.py tests/test_cuda_quantized.py -rA 2>&1 | tee "$logs/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|tie|DIFFERS"
}
run_bench() {
  timeout 90 python3 -m benchmarks.lora_kernel_count 2>&1 | tee "$logs/kernel-count.log"
  timeout 300 python3 -m benchmarks.cuda --batches 8 32 64 --rounds 2 --steps 32 --kernels masked stacked gathered \
    --quantization int8 int4 --no-peft --prefill 8 64 --prefill 8 256 2>&1 | tee "$logs/bench.log"
  (cd .gpu/trees/last-gpu-run && PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD timeout 150 python3 -m benchmarks.cuda --batches 8 32 64 \
    --rounds 2 --steps 32 --kernels masked --no-peft --prefill 8 64) 2>&1 | tee "$logs/bench-last-gpu-run.log"
}
run_paged() {
  timeout 240 python3 -m benchmarks.paged_decode --baseline .gpu/trees/slot-cache --device cuda --batches 8 64 \
    --pairs 2 --prompt-len 200 2>&1 | tee "$logs/paged.log"
}
run_trace() {
  timeout 240 python3 -m benchmarks.cuda --batches 8 --rounds 1 --steps 8 --kernels masked stacked --no-peft \
    --prefill 8 64 --trace /tmp/gpu-trace --trace-batches 8 2>&1 | tee "$logs/trace.log"
}
case $stage in
  tests) run_tests;;
  bench) run_bench;;
  paged) run_paged;;
  trace) run_trace;;
  all) run_tests; run_bench; run_paged;;
  *) echo "unknown stage $stage (tests, bench, paged, trace or all)"; exit 2;;
esac
