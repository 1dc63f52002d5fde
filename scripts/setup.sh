#!/usr/bin/env bash
# Create .venv (if missing) and install the project with the given extras (default: server, what
# scripts/serve.sh needs; "test" includes it); safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-server}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build on CPU machines
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
  touch "$stamp"
fi
