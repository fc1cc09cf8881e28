#!/usr/bin/env bash
# Run the test suite. Creates and fills .venv (with the dev extra) on first use.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/project/test_package.py -m "not slow"`.
# `--fast` first: only the tests that start no process (-m "not processes"; tests/conftest.py fails a test
# that starts one unmarked), under 2 minutes on 2 cores, e.g. `bash scripts/test.sh --fast -k bucket`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ddpx_setup_env dev
cd "$REPO_ROOT"
tier=()
if [ "${1:-}" = "--fast" ]; then
    shift
    tier=(-m "not processes")
fi
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q "${tier[@]}" "$@"
