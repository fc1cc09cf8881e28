# Shared set-up, sourced by scripts/demo.sh and scripts/test.sh (not run on its own).
#
#   ddpx_setup_env EXTRA   make sure <repo>/.venv exists and holds this repo, installed editable with the
#                          optional dependencies EXTRA (e.g. "dev"), pinned by constraints.txt.
#
# The install is skipped when a stamp in .venv says the same pyproject.toml, constraints.txt and EXTRA were
# already installed; edit either file (or delete .venv) and the next run installs again.
# Sets REPO_ROOT and VENV_PYTHON. Set PYTHON to choose the interpreter that creates .venv (default python3).

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV_PYTHON=$REPO_ROOT/.venv/bin/python

ddpx_setup_env() {
    local extra=$1
    local python=${PYTHON:-python3}
    cd "$REPO_ROOT"

    if [ ! -d .venv ]; then
        if ! command -v "$python" >/dev/null 2>&1; then
            echo "error: '$python' not found; install Python >= 3.10 or set PYTHON=/path/to/python3" >&2
            return 1
        fi
        if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
            echo "error: lightning-ddpx needs Python >= 3.10, but '$python' is $("$python" -V 2>&1);" \
                "set PYTHON=/path/to/python3.10-or-newer" >&2
            return 1
        fi
        echo "Creating .venv with $("$python" -V 2>&1) ..." >&2
        if ! "$python" -m venv .venv; then
            rm -rf .venv
            echo "error: '$python -m venv' failed; on Debian/Ubuntu install the python3-venv package" >&2
            return 1
        fi
    fi
    if [ ! -x "$VENV_PYTHON" ] || ! "$VENV_PYTHON" -c '' 2>/dev/null; then
        echo "error: $VENV_PYTHON is missing or broken (was the repo moved?); delete .venv and re-run" >&2
        return 1
    fi

    local stamp=.venv/.lightning-ddpx-$extra.stamp
    local key
    key=$("$VENV_PYTHON" - "$extra" <<'PY'
import hashlib, sys
digest = hashlib.sha256(sys.argv[1].encode() + sys.version.encode())
for name in ("pyproject.toml", "constraints.txt"):
    with open(name, "rb") as f:
        digest.update(f.read())
print(digest.hexdigest())
PY
)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
        return 0
    fi
    echo "Installing lightning-ddpx[$extra] into .venv (first run, or pyproject.toml/constraints.txt changed) ..." >&2
    "$VENV_PYTHON" -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[$extra]"
    echo "$key" > "$stamp"
}
