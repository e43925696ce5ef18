#!/usr/bin/env bash
# Install everything, then run the test suite (what CI runs: .ci/run calls this).
#   scripts/test.sh           the whole suite
#   scripts/test.sh --quick   the pure core, the router's parts, the contracts and the repository
#                             checks, in process: no node processes, no models served
#                             (pytest -m quick; tests/conftest.py says which paths)
# Tests run on three pytest-xdist workers: many real-process tests wait on their nodes, and a
# third worker fills those waits (on a 2-core machine, same tree: two 591 s, three 533-549 s,
# four 541 s). `--dist loadfile` keeps a module on one worker, so its cluster fixtures start
# once, and free_port gives each worker its own ports; `--no-loadscope-reorder` keeps
# tests/conftest.py's order (modules that start processes first: xdist's own order, most tests
# first, left the few long modules to run alone at the end). Pass `-n 0` for one process.
# Any other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
selection=()
if [ "${1:-}" = --quick ]; then
  shift
  selection=(-m quick)
fi
workers=(-n 3 --dist loadfile --no-loadscope-reorder)
for arg in "$@"; do
  case "$arg" in -n|-n*|--numprocesses*) workers=() ;; esac
done
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q ${workers[@]+"${workers[@]}"} ${selection[@]+"${selection[@]}"} "$@"
