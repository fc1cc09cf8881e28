"""The fast tier's rule (tests/conftest.py): a test not marked ``processes`` that starts a process fails,
naming itself and the marker, before the process starts; a marked one starts processes as before.

The unmarked tests here run under the rule themselves: if an entry point slipped past the guard they call,
the test's own guard would fail them."""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import subprocess
import sys
from typing import Callable

import pytest

from tests.conftest import PROCESSES_MARKER, forbid_processes

pytest_plugins = ["pytester"]

_INNER_CONFTEST = (
    "from tests.conftest import pytest_runtest_call, pytest_runtest_setup, pytest_runtest_teardown\n"
)
_INNER_INI = (
    f"[pytest]\naddopts = --strict-markers -p no:cacheprovider\nmarkers =\n    {PROCESSES_MARKER}: x\n"
)


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run([sys.executable, "-c", "pass"]),
        lambda: multiprocessing.get_context("fork").Process(target=print).start(),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        # how multiprocessing starts its helpers (the resource tracker, the forkserver); called directly, since
        # in a full run an earlier test may already have started the resource tracker
        lambda: multiprocessing.util.spawnv_passfds(sys.executable, [sys.executable, "-c", "pass"], []),
        lambda: os.fork(),  # looked up at the call, as every caller does
        lambda: os.system("true"),
        lambda: os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], os.environ),
    ],
    ids=["subprocess", "mp-fork", "mp-spawn", "mp-helper", "os.fork", "os.system", "posix_spawn"],
)
def test_every_entry_point_is_refused(start: Callable[[], object]) -> None:
    before = (vars(subprocess.Popen)["_execute_child"], os.fork, os.system)  # this test's own guard
    with forbid_processes("tests/x.py::test_y") as attempts:
        with pytest.raises(
            pytest.fail.Exception, match=r"tests/x.py::test_y started a process .* `processes`"
        ):
            start()
    assert len(attempts) == 1
    assert (vars(subprocess.Popen)["_execute_child"], os.fork, os.system) == before


def test_unmarked_test_that_starts_a_process_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(_INNER_CONFTEST)
    pytester.makeini(_INNER_INI)
    pytester.makepyfile(
        """
        import subprocess, sys

        def test_starts():
            subprocess.run([sys.executable, "-c", "pass"])

        def test_swallows():
            try:
                subprocess.run([sys.executable, "-c", "pass"])
            except BaseException:
                pass

        def test_starts_none():
            assert True
        """
    )
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        ["*test_starts started a process (subprocess.Popen) but is not marked `processes`*"]
    )
    result.stdout.fnmatch_lines(["*test_swallows started a process*"])


@pytest.mark.processes
def test_marked_test_starts_processes(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(_INNER_CONFTEST)
    pytester.makeini(_INNER_INI)
    pytester.makepyfile(
        """
        import subprocess, sys
        import pytest

        @pytest.mark.processes
        def test_starts():
            assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
        """
    )
    pytester.runpytest_inprocess().assert_outcomes(passed=1)
