"""The documentation site builds with ``mkdocs build --strict`` (nav complete, no broken page links)."""

from __future__ import annotations

import shutil
import sys

import pytest

from tests.dist_utils import run_job


@pytest.mark.processes
def test_mkdocs_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra: pip install -e '.[dev]'")
    done = run_job(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], 120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("strategy", "checkpointing", "hooks"):
        assert (tmp_path / "site" / page / "index.html").exists()
    shutil.rmtree(tmp_path / "site")


def test_the_differences_page_names_tests_that_exist():
    """docs/differences.md backs each row with a test (``file.py::test_name``, or ``::test_name`` after a
    file named earlier in the same cell): every one it names must exist, so a renamed test cannot leave a row
    claiming a proof that is gone."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "differences.md").read_text()
    named = []
    for row in page.splitlines():
        current = None
        for file, test in re.findall(r"`(?:([\w/]+\.py))?::(test_\w+)`", row):
            current = file or current
            assert current, f"a test named without its file in: {row[:80]}"
            named.append((current, test))
    assert len(named) > 30
    missing = []
    for file, test in named:
        path = root / "tests" / file
        if not path.exists() or not re.search(rf"^def {test}\(", path.read_text(), re.M):
            missing.append(f"{file}::{test}")
    assert not missing, f"docs/differences.md names tests that do not exist: {missing}"
