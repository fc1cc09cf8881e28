"""The peer job: torch's own DDP test cases (from the torch wheel) pass with our class substituted for torch's.

Runs :mod:`tests.peer.torch_ddp_driver` twice, 2 gloo ranks each, a few seconds per run: with torch's class
(every candidate must pass: a torch upgrade that renames or skips one shows up here, not as silent loss of
coverage) and with ours (every candidate but the excluded ones must pass; the pending ones must still fail,
so that the list is shortened when they are fixed). tests/peer/cases.py says which cases and why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.dist_utils import job_env, run_job
from tests.peer.cases import CANDIDATES, EXCLUDED, PENDING


def run_driver(impl: str, tmp_path: Path) -> dict[str, dict]:
    results = tmp_path / f"{impl}.json"
    completed = run_job(
        [
            sys.executable,
            "-m",
            "tests.peer.torch_ddp_driver",
            "--impl",
            impl,
            "--all",
            "--json",
            str(results),
        ],
        timeout=300,
        env=job_env(),
    )
    assert results.exists(), (
        f"the driver did not finish:\n{completed.stdout[-3000:]}\n{completed.stderr[-5000:]}"
    )
    return json.loads(results.read_text())


def failures(outcomes: dict[str, dict], names: list[str], expected: str) -> dict[str, str]:
    return {
        name: f"{outcomes.get(name, {}).get('status', 'not run')}: {outcomes.get(name, {}).get('detail', '')}"
        for name in names
        if outcomes.get(name, {}).get("status") != expected
    }


def test_the_lists_name_candidates() -> None:
    assert set(EXCLUDED) <= set(CANDIDATES) and set(PENDING) <= set(CANDIDATES)
    assert not set(EXCLUDED) & set(PENDING)


@pytest.mark.slow
@pytest.mark.processes
def test_torch_class_passes_every_candidate(tmp_path: Path) -> None:
    outcomes = run_driver("torch", tmp_path)
    assert not failures(outcomes, list(CANDIDATES), "passed")


@pytest.mark.slow
@pytest.mark.processes
def test_our_class_passes_torch_cases(tmp_path: Path) -> None:
    outcomes = run_driver("ours", tmp_path)
    driven = [name for name in CANDIDATES if name not in EXCLUDED and name not in PENDING]
    assert not failures(outcomes, driven, "passed")
    still_pending = failures(outcomes, list(PENDING), "failed")
    assert not still_pending, (
        f"these pass now: remove them from PENDING in tests/peer/cases.py: {still_pending}"
    )
