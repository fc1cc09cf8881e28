#!/usr/bin/env bash
# The GPU check: one command, about 5 minutes on an H200 (each part has a time limit). It runs
#   (a) every test marked `cuda` (pytest -m cuda tests/): our module against torch's DDP over NCCL and over
#       gloo on the GPU, backward under a side stream with every hook, the optimizer overlap, torch.compile,
#       Lightning's Trainer(accelerator="gpu") with "ddpx" against "ddp" in 32-true, 16-mixed and bf16-mixed;
#   (b) the GPU benchmark (benchmarks/bench_gpu.py): our step against torch's DDP on a ResNet-50-like CNN and
#       a GPT-2-small-like transformer (the GPU sets the pace), and on two launch-bound models timed
#       free-running (the CPU sets the pace), NCCL world size 1 and two ranks sharing the GPU over gloo,
#       written to benchmarks/results/gpu_*.json;
# and prints a summary table. Exit status: 0 when every part passed, or when there is no GPU (it says what
# it skipped); non-zero when a part failed or ran out of time.
#
#   bash scripts/gpu_check.sh                  # on a machine with a GPU
#   bash scripts/gpu_check.sh --dry-run        # anywhere: the CPU side (CI runs it: tests/engine/test_gpu_check.py)
#   bash scripts/gpu_check.sh --results-dir DIR
#
# --dry-run (on any machine, GPUs hidden): the cuda tests are collected and skip, and the benchmark runs its
# own code on the CPU with tiny models (gpu_dryrun_*.json), so neither can rot on machines without a GPU.
#
# Which Python (none of this needs more network than a package registry):
#   1. $DDPX_PYTHON, if set (this repo is put on its PYTHONPATH);
#   2. else a system python3 whose torch sees a GPU: its CUDA build is used as it is, with this repo on
#      PYTHONPATH; packages it lacks (Lightning, pytest, ...) are installed into .venv-gpu, a venv over the
#      system's site-packages, so the system's torch stays (without a registry it goes on without them, and
#      what needs them fails);
#   3. else .venv from scripts/setup_env.sh (the README's set-up). constraints.txt pins torch's version only
#      (`torch==2.13.0`); the CPU wheel comes from the build machines' own wheel directory. Where nvidia-smi
#      shows a GPU and that torch has no CUDA, the same version is reinstalled from PyPI, whose Linux wheels
#      are CUDA builds ($DDPX_TORCH_INDEX picks another index, e.g. https://download.pytorch.org/whl/cu128).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"

DRY_RUN=0
RESULTS_DIR=benchmarks/results
TESTS_TIMEOUT_S=${DDPX_GPU_TESTS_TIMEOUT_S:-360}   # part (a)
BENCH_TIMEOUT_S=${DDPX_GPU_BENCH_TIMEOUT_S:-300}   # each set-up of part (b)
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --results-dir) RESULTS_DIR=$2; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# What the package and its tests import (pytest-timeout is optional here: every part has a time limit)
NEEDED_MODULES=(torch lightning numpy typing_extensions pytest)

torch_sees_gpu() {  # PYTHON: exit 0 if its torch imports and sees a CUDA GPU
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)' \
        >/dev/null 2>&1
}

missing_modules() {  # PYTHON: the NEEDED_MODULES it cannot import, space-separated
    "$1" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' \
        "${NEEDED_MODULES[@]}"
}

nvidia_gpu_present() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

use_repo_on_pythonpath() {
    export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
}

system_python_with_gpu() {  # sets PY to the system python3 (or .venv-gpu over it); returns 1 if unusable
    local system
    system=$(command -v python3 || true)
    [ -n "$system" ] && torch_sees_gpu "$system" || return 1
    local missing
    missing=$(missing_modules "$system")
    if [ -z "$missing" ]; then
        PY=$system
        use_repo_on_pythonpath
        return 0
    fi
    echo "The system's python3 has a CUDA torch but lacks: $missing; installing them into .venv-gpu" \
        "(a venv over the system's site-packages, so its torch stays) ..." >&2
    [ -x .venv-gpu/bin/python ] || "$system" -m venv --system-site-packages .venv-gpu
    local pin
    pin=$(mktemp)
    "$system" -c 'import torch; print("torch==" + torch.__version__)' > "$pin"
    if ! .venv-gpu/bin/python -m pip install --quiet --disable-pip-version-check -c "$pin" -e ".[dev]"; then
        rm -f "$pin"
        # Go on with what there is: the parts that need the missing packages fail and say so, the others run.
        echo "warning: could not install $missing next to the system's CUDA torch (no package registry?);" \
            "going on with $system: what needs them will fail. Install them into $system, or point" \
            "DDPX_PYTHON at a Python that has them and a CUDA torch." >&2
        PY=$system
        use_repo_on_pythonpath
        return 0
    fi
    rm -f "$pin"
    PY=$REPO_ROOT/.venv-gpu/bin/python
}

cuda_torch_into_venv() {  # .venv has a CPU torch but the machine has a GPU: the same version's CUDA build
    local version index=${DDPX_TORCH_INDEX:-https://pypi.org/simple}
    version=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
    echo "nvidia-smi shows a GPU but .venv's torch $version has no CUDA: installing torch==$version from $index" \
        "(--isolated: this machine's pip settings, which may prefer a local CPU wheel, are ignored) ..." >&2
    "$PY" -m pip uninstall --quiet -y torch
    if ! "$PY" -m pip install --isolated --quiet --disable-pip-version-check --index-url "$index" \
        "torch==$version"; then
        echo "error: could not install a CUDA build of torch==$version from $index (set DDPX_TORCH_INDEX," \
            "or DDPX_PYTHON to a Python with a CUDA torch); then re-run." >&2
        exit 1
    fi
    if ! torch_sees_gpu "$PY"; then
        echo "error: torch==$version from $index still sees no GPU (driver too old for its CUDA? set" \
            "DDPX_TORCH_INDEX to a matching index, e.g. https://download.pytorch.org/whl/cu126)" >&2
        exit 1
    fi
}

choose_python() {  # sets PY
    if [ -n "${DDPX_PYTHON:-}" ]; then
        PY=$DDPX_PYTHON
        use_repo_on_pythonpath
        return
    fi
    if system_python_with_gpu; then
        return
    fi
    if [ $DRY_RUN = 0 ] && ! nvidia_gpu_present; then
        PY=""  # no GPU anywhere: nothing to set up
        return
    fi
    # shellcheck source=scripts/setup_env.sh
    source scripts/setup_env.sh
    ddpx_setup_env dev
    cd "$REPO_ROOT"
    PY=$VENV_PYTHON
    if [ $DRY_RUN = 0 ] && nvidia_gpu_present && ! torch_sees_gpu "$PY"; then
        cuda_torch_into_venv
    fi
}

SKIPPED="(a) the cuda-marked tests (pytest -m cuda tests/) and (b) the GPU benchmark (benchmarks/bench_gpu.py)"

if [ $DRY_RUN = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""  # the CPU side only, on any machine
fi
choose_python
GPU=0
if [ $DRY_RUN = 0 ] && [ -n "$PY" ] && torch_sees_gpu "$PY"; then
    GPU=1
fi
if [ $GPU = 0 ] && [ $DRY_RUN = 0 ]; then
    echo "gpu_check: no CUDA GPU here${PY:+ (none visible to $PY)}: skipped $SKIPPED."
    echo "gpu_check: run with --dry-run to exercise their CPU side; on a GPU machine this runs them (about 5 min)."
    exit 0
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
SUMMARY=()
FAILED=0

run_part() {  # NAME TIMEOUT_S COMMAND...: run it under a time limit, log it, add a summary row
    local name=$1 limit=$2
    shift 2
    local log=$LOGS/part${#SUMMARY[@]}.log start=$SECONDS rc=0
    echo
    echo "=== $name (at most ${limit} s): $*"
    { timeout --kill-after=20 "$limit" "$@" 2>&1 || rc=$?; echo "$rc" > "$log.rc"; } | tee "$log"
    rc=$(cat "$log.rc")
    local status=passed detail
    if [ $rc = 124 ] || [ $rc = 137 ]; then
        status="TIMED OUT"
        FAILED=1
    elif [ $rc != 0 ]; then
        status="FAILED (rc $rc)"
        FAILED=1
    fi
    # pytest's last line, or where the benchmark wrote its results
    detail=$(grep -E '^[=]* *[0-9]+ (passed|failed|skipped|error|deselected)|results written to' "$log" \
        | tail -n 3 | sed -E 's/^=+ *| *=+$//g; s/ in [0-9.]+s.*$//; s/^.*results written to /wrote /' \
        | paste -sd ';' - || true)
    SUMMARY+=("$(printf '%-44s %-16s %6s s   %s' "$name" "$status" "$((SECONDS - start))" "$detail")")
}

if [ $GPU = 1 ]; then
    echo "gpu_check: $("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    run_part "(a) cuda-marked tests" "$TESTS_TIMEOUT_S" \
        "$PY" -m pytest -q -m cuda tests/ -rs -p no:cacheprovider
    for setup in nccl_ws1 gloo_2ranks; do
        run_part "(b) GPU benchmark, $setup" "$BENCH_TIMEOUT_S" \
            "$PY" benchmarks/bench_gpu.py --setups "$setup" --results-dir "$RESULTS_DIR"
    done
else
    run_part "(a) cuda-marked tests (skip: dry run)" "$TESTS_TIMEOUT_S" \
        "$PY" -m pytest -q -m cuda tests/ -rs -p no:cacheprovider
    run_part "(b) GPU benchmark, CPU dry run (tiny models)" "$BENCH_TIMEOUT_S" \
        "$PY" benchmarks/bench_gpu.py --dry-run --results-dir "$RESULTS_DIR"
fi

echo
echo "=== gpu_check summary"
printf '%-44s %-16s %8s   %s\n' part status time detail
for row in "${SUMMARY[@]}"; do
    echo "$row"
done
if [ $GPU = 0 ]; then
    echo "gpu_check: dry run, no GPU used: skipped $SKIPPED on a GPU; ran their CPU side."
fi
if [ $FAILED != 0 ]; then
    echo "gpu_check: FAILED (see the parts above)"
    exit 1
fi
echo "gpu_check: ok"
