"""What every test shares: Lightning's advice for real training hidden, and its INFO banners; the hook
name registry as it was before the test (a name a test registers must not reach later tests, whose rank
processes would not know it); and the rule that keeps the fast tier (``-m "not processes"``, ``bash
scripts/test.sh --fast``) free of processes: a test not marked ``processes`` that starts one fails.

Starting processes (a function on N gloo ranks, a script, a CLI, torchrun) is :mod:`tests.dist_utils`'s
job; rank processes do not read this file, so what they need (``quiet()``) is called there explicitly.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.process
import multiprocessing.util
import os
import subprocess
import warnings
from collections.abc import Generator, Iterator
from typing import Any, Callable

import pytest

from tests.dist_utils import LIGHTNING_ADVICE

_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")


@pytest.fixture(autouse=True)
def quiet_lightning() -> Iterator[None]:
    """No advice meant for real training (dataloader workers, log intervals, an unused GPU), and no INFO
    banners ("GPU available: ...") in the reports of tests that train in the test process."""
    for message in LIGHTNING_ADVICE:
        warnings.filterwarnings("ignore", message=message)  # pytest restores the filters after each test
    loggers = [logging.getLogger(name) for name in _LIGHTNING_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


@pytest.fixture(autouse=True)
def restore_hook_registry() -> Iterator[None]:
    from lightning_ddpx.hooks import registry

    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


@pytest.fixture(autouse=True)
def torch_backend_flags_left_as_found() -> Iterator[None]:
    """Importing torch's own test helpers (``torch.testing._internal``, which some tests use as oracles)
    freezes ``torch.backends``' global flags for the whole process (``disable_global_flags``); every later
    ``Trainer(...)`` in it then fails setting ``cudnn.benchmark``. A test leaves the flags as it found them,
    so no test depends on which ran before it."""
    import torch.backends

    frozen = torch.backends.flags_frozen()
    yield
    if not frozen and torch.backends.flags_frozen():
        # the switch disable_global_flags() turns off, in the globals its functions read
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


# ------------------------------------------------------------------------------------ the fast tier's rule
PROCESSES_MARKER = "processes"
# Every way Python starts a process, as (owner, attribute, what it starts). multiprocessing's own helper
# processes (its resource tracker, the forkserver) start through spawnv_passfds, not Popen.
_ENTRY_POINTS: tuple[tuple[Any, str, str], ...] = (
    (subprocess.Popen, "_execute_child", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),
    (multiprocessing.util, "spawnv_passfds", "a multiprocessing helper (resource tracker, forkserver)"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (os, "system", "os.system"),
)


def _refusal(test: str, what: str) -> str:
    return (
        f"{test} started a process ({what}) but is not marked `{PROCESSES_MARKER}`: add "
        f"`@pytest.mark.{PROCESSES_MARKER}` to it (or `pytestmark = pytest.mark.{PROCESSES_MARKER}` to a "
        f'module whose every test starts processes), so that the fast tier (-m "not {PROCESSES_MARKER}", '
        "bash scripts/test.sh --fast) keeps starting none"
    )


@contextlib.contextmanager
def forbid_processes(test: str) -> Iterator[list[str]]:
    """Within the block, each entry point of :data:`_ENTRY_POINTS` fails ``test`` (pytest's ``Failed``, which
    ``except Exception`` does not catch) before any process starts. Yields the attempts, so that a test that
    swallowed the failure still fails."""
    attempts: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            attempts.append(what)
            pytest.fail(_refusal(test, what))

        return refused

    present = [(owner, name, what) for owner, name, what in _ENTRY_POINTS if name in vars(owner)]
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in present]
    for owner, name, what in present:
        setattr(owner, name, refuse(what))
    try:
        yield attempts
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _guarded(item: pytest.Item) -> Generator[None, Any, Any]:
    """One phase of ``item`` (set-up, call, teardown) under :func:`forbid_processes`, unless it is marked."""
    if item.get_closest_marker(PROCESSES_MARKER) is not None:
        return (yield)
    with forbid_processes(item.nodeid) as attempts:
        result = yield
    if attempts:  # the test caught the failure and went on
        pytest.fail(_refusal(item.nodeid, attempts[0]))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))
