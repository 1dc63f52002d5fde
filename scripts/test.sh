#!/usr/bin/env bash
# Set up with the test extras, then run the whole test suite, in two worker processes (pytest-xdist; one test
# file per worker at a time: module fixtures stay whole). Extra args go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
# The suite runs on the allocator the server runs on (service/allocator.py: TCMalloc where the system has it), so
# what the in-process servers measure of their heap (a constraint's memory, host_memory.heap_bytes) is the server's.
tcmalloc=$(.venv/bin/python -c "from service import allocator; print(allocator.find_tcmalloc() or '')")
if [ -n "$tcmalloc" ]; then
  export LD_PRELOAD="$tcmalloc${LD_PRELOAD:+:$LD_PRELOAD}"
fi
exec .venv/bin/python -m pytest -n "${LORA_SERVE_TEST_WORKERS:-2}" --dist loadfile "$@"
