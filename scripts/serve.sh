#!/usr/bin/env bash
# Set up, then serve the embedded demo model (and its demo adapters) on :50051. Extra args go to lora-serve.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/lora-serve "$@"
