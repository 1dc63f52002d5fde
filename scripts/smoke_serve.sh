#!/usr/bin/env bash
# Run the README's first command as a new user would (runtime install only, no test extras), stream one
# generation through the CLI, then check that SIGTERM drains and exits 0. CI runs this before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${1:-50151}"
log="$(mktemp)"
scripts/serve.sh --port "$port" >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
client() { .venv/bin/lora-client --target "localhost:$port" --timeout 30 "$@"; }
for _ in $(seq 600); do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "smoke: the server exited before it was ready:"; tail -20 "$log"; exit 1
  fi
  if [ -x .venv/bin/lora-client ] && [ "$(client health 2>/dev/null)" = "SERVING" ]; then break; fi
  sleep 1
done
[ "$(client health)" = "SERVING" ] || { echo "smoke: not SERVING after 600 s"; tail -20 "$log"; exit 1; }
out="$(client generate "What is the capital of France?" --chat --temperature 0 --max-new-tokens 16)"
case "$out" in *Paris*) ;; *) echo "smoke: the demo model did not answer Paris: '$out'"; tail -20 "$log"; exit 1;; esac
echo "smoke: generated: $out"
out="$(client generate "What is the capital of France?" --chat --adapter pirate --temperature 0 --max-new-tokens 24)"
case "$out" in Arr*) ;; *) echo "smoke: the pirate adapter did not talk like a pirate: '$out'"; exit 1;; esac
echo "smoke: pirate: $out"
choice="$(client generate "Capital of France?" --choice Paris --choice London --temperature 1 --seed 1 | head -1)"
case "$choice" in Paris|London) ;; *) echo "smoke: --choice gave '$choice'"; exit 1;; esac
echo "smoke: structured output: $choice"
kill -TERM "$pid"
status=0; wait "$pid" || status=$?
[ "$status" -eq 0 ] || { echo "smoke: lora-serve exited with $status after SIGTERM"; tail -20 "$log"; exit 1; }
echo "smoke: serve command OK (ready, streamed, drained on SIGTERM)"
