#!/usr/bin/env bash
# Train a small MLP on 2 CPU processes with lightning_ddpx.DistributedDataParallel (examples/engine_demo.py).
# Creates and fills .venv on first use. Extra arguments go to the demo, e.g. --reference for torch's DDP.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ddpx_setup_env examples
cd "$REPO_ROOT"
OMP_NUM_THREADS=1 .venv/bin/python examples/engine_demo.py "$@"
