#!/usr/bin/env bash
# Install everything, then run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m mlxcel_plugin.quickstart "$@"
