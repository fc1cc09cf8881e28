#!/usr/bin/env bash
# Run the test suite. Creates and fills .venv (with the dev extra) on first use.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/test_package.py -m "not slow"`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ddpx_setup_env dev
cd "$REPO_ROOT"
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q "$@"
