"""What every test shares: Lightning's advice for real training hidden, and its INFO banners; the hook
name registry as it was before the test (a name a test registers must not reach later tests, whose rank
processes would not know it).

Starting processes (a function on N gloo ranks, a script, a CLI, torchrun) is :mod:`tests.dist_utils`'s
job; rank processes do not read this file, so what they need (``quiet()``) is called there explicitly.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

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
