"""The documentation site builds with ``mkdocs build --strict`` (nav complete, no broken page links)."""

from __future__ import annotations

import shutil
import sys

import pytest

from tests.dist_utils import run_job


def test_mkdocs_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra: pip install -e '.[dev]'")
    done = run_job(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], 120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("strategy", "checkpointing", "hooks"):
        assert (tmp_path / "site" / page / "index.html").exists()
    shutil.rmtree(tmp_path / "site")
