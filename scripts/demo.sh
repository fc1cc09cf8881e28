#!/usr/bin/env bash
# A real Lightning training on 2 CPU processes with strategy DDPXStrategy + PowerSGD on scikit-learn's digits,
# a checkpoint and a resume from it (examples/lightning_demo.py). Creates and fills .venv on first use.
# Extra arguments go to the demo, e.g. --hook allreduce.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ddpx_setup_env examples
cd "$REPO_ROOT"
OMP_NUM_THREADS=1 .venv/bin/python examples/lightning_demo.py "$@"
