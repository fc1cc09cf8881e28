#!/usr/bin/env bash
# The oldest Lightning pyproject.toml claims (lightning>=2.5), proved: the strategy, Fabric, checkpoint, CLI
# and option tests run in a separate venv, .venv-floor, with lightning==2.5.0 and the pinned torch.
# torch's floor (2.6) cannot be proved on these machines, which install only torch 2.13's CPU wheel
# (README.md, "Supported versions"). Extra arguments go to pytest. Left to the main suite: importing each of
# our Lightning-layer modules first (our own import graph; the registration with 2.5 is checked here by the
# import-order tests of the same file).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LIGHTNING_FLOOR=2.5.0
python=${PYTHON:-python3}
if [ ! -x .venv-floor/bin/python ]; then
    "$python" -m venv .venv-floor
fi
stamp=.venv-floor/.lightning-$LIGHTNING_FLOOR.stamp
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    echo "Installing lightning-ddpx with lightning==$LIGHTNING_FLOOR into .venv-floor ..." >&2
    .venv-floor/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt \
        "lightning==$LIGHTNING_FLOOR" -e ".[examples]" pytest pytest-timeout
    touch "$stamp"
fi
.venv-floor/bin/python -c "import lightning; assert lightning.__version__ == '$LIGHTNING_FLOOR', lightning.__version__"
OMP_NUM_THREADS=1 .venv-floor/bin/python -m pytest -q -p no:cacheprovider \
    tests/project/test_layers.py tests/lightning/test_options.py tests/lightning/test_strategy_unit.py tests/lightning/test_strategy_training.py \
    tests/lightning/test_fabric.py tests/lightning/test_strategy_checkpoint.py tests/lightning/test_ddp_kwargs.py tests/lightning/test_strategy_cli.py \
    tests/lightning/test_uneven_strategies.py tests/lightning/test_overlap_optimizer_strategy.py \
    --deselect tests/project/test_layers.py::test_any_lightning_layer_module_imported_first_registers_the_names "$@"
