#!/usr/bin/env bash
# Install everything, then run the test suite (what CI runs: .ci/run calls this).
#   scripts/test.sh           the whole suite
#   scripts/test.sh --quick   the pure core, the router's parts, the contracts and the repository
#                             checks, in process: no node processes, no models served
#                             (pytest -m quick; tests/conftest.py says which paths)
# Any other arguments go to pytest, e.g. `-n 2 --dist loadfile` for pytest-xdist workers (a
# module stays on one worker, so its cluster fixtures start once; free_port gives each worker
# its own ports).
set -euo pipefail
cd "$(dirname "$0")/.."
selection=()
if [ "${1:-}" = --quick ]; then
  shift
  selection=(-m quick)
fi
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q ${selection[@]+"${selection[@]}"} "$@"
