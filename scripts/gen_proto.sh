#!/usr/bin/env sh
# Regenerate service/_proto/ from proto/loraserve/v1/*.proto. Run after editing a .proto; commit the result.
set -eu
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m service.tools.gen_proto "$@"
