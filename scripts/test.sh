#!/usr/bin/env bash
# Set up with the test extras, then run the whole test suite, in two worker processes (pytest-xdist; one test
# file per worker at a time: module fixtures stay whole). Extra args go to pytest (`-n 0`: one process).
#
# Tests marked `quiet` (a stream's pace beside an attack, against its pace alone) run afterwards in one process
# with nothing beside them: next to another worker's compile on 2 cores a victim's gap measured 389 ms against
# 39 ms alone, a neighbour's noise, not the server's. They run on TCMalloc where the system has it, the allocator
# the server runs on (service.allocator), so its heap count measures a constraint's memory (host_memory).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
status=0
.venv/bin/python -m pytest -n "${LORA_SERVE_TEST_WORKERS:-2}" --dist loadfile -m "not quiet" "$@" || status=$?
[ "$status" -eq 5 ] && status=0  # nothing collected (a selection with only quiet tests)
tcmalloc=$(.venv/bin/python -c "from service.allocator import find_tcmalloc; print(find_tcmalloc() or '')")
quiet=0
LD_PRELOAD="${tcmalloc}${LD_PRELOAD:+:$LD_PRELOAD}" .venv/bin/python -m pytest -n 0 -m quiet "$@" || quiet=$?
[ "$quiet" -eq 5 ] && quiet=0
exit $(( status != 0 ? status : quiet ))
