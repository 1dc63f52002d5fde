#!/usr/bin/env bash
# Set up with the test extras, then run the whole test suite, in two worker processes (pytest-xdist; one test
# file per worker at a time: module fixtures stay whole). Extra args go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec .venv/bin/python -m pytest -n "${LORA_SERVE_TEST_WORKERS:-2}" --dist loadfile "$@"
