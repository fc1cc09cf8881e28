"""The package's layers: the engine imports without Lightning, Lightning names load lazily and register the
strategy names whichever is imported first, and every module path from before the split still imports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import lightning_ddpx
from tests.dist_utils import run_job


def _python(code: str) -> str:
    result = run_job([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.processes
def test_engine_names_import_without_lightning() -> None:
    loaded = _python(
        "import sys\n"
        "from lightning_ddpx import DistributedDataParallel, GradBucket, BucketInfo, compile_model\n"
        "import lightning_ddpx.hooks, lightning_ddpx.engine.reducer.reducer\n"
        "print(sorted(m for m in sys.modules if m == 'lightning' or m.startswith('lightning.')))"
    )
    assert loaded == "[]"


@pytest.mark.parametrize("order", ["ddpx first", "lightning first"])
@pytest.mark.processes
def test_strategy_names_registered_whichever_is_imported_first(order: str) -> None:
    imports = "import lightning_ddpx\nimport lightning\n"
    if order == "lightning first":
        imports = "import lightning\nimport lightning_ddpx\n"
    out = _python(
        imports + "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "print('ddpx' in StrategyRegistry, 'ddpx_powersgd' in StrategyRegistry, 'ddpx' in STRATEGY_REGISTRY)"
    )
    assert out == "True True True"


@pytest.mark.processes
def test_trainer_resolves_the_name_when_lightning_is_imported_after_us() -> None:
    out = _python(
        "import lightning_ddpx\nfrom lightning.pytorch import Trainer\n"
        "trainer = Trainer(strategy='ddpx', accelerator='cpu', devices=1, logger=False)\n"
        "print(type(trainer.strategy).__qualname__)"
    )
    assert out.splitlines()[-1] == "DDPXStrategy"


def test_lazy_names_are_the_objects_at_their_homes() -> None:
    from lightning_ddpx.lightning.checkpoints.checkpoint_io import AtomicCheckpointIO
    from lightning_ddpx.lightning.features.uneven import UnevenInputsError
    from lightning_ddpx.lightning.strategies.trainer import DDPXStrategy

    assert lightning_ddpx.DDPXStrategy is DDPXStrategy
    assert lightning_ddpx.AtomicCheckpointIO is AtomicCheckpointIO
    assert lightning_ddpx.UnevenInputsError is UnevenInputsError
    assert set(lightning_ddpx.__all__) <= set(dir(lightning_ddpx))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        lightning_ddpx.NoSuchName  # noqa: B018


@pytest.mark.parametrize("old, new", sorted(lightning_ddpx._MOVED_MODULES.items()))
def test_module_paths_from_before_the_layers_still_import(old: str, new: str) -> None:
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)


def test_powersgd_hooks_keep_their_public_module_name() -> None:
    """Checkpoints and the settings check name a callable hook by module and name."""
    from lightning_ddpx.hooks import batched_powersgd_hook, powersgd_hook

    assert powersgd_hook.__module__ == batched_powersgd_hook.__module__ == "lightning_ddpx.hooks.powersgd"


_PACKAGE_ROOT = Path(lightning_ddpx.__file__).parent.parent
LIGHTNING_LAYER = sorted(
    ".".join(path.relative_to(_PACKAGE_ROOT).with_suffix("").parts)
    for path in (_PACKAGE_ROOT / "lightning_ddpx" / "lightning").rglob("*.py")
    if path.stem != "__init__"
)


@pytest.mark.processes
def test_any_lightning_layer_module_imported_first_registers_the_names() -> None:
    """Importing a module of the Lightning layer first imports Lightning, whose import registers our names:
    that must not meet one of our modules half-initialised (a warning would say the registration failed).
    Each module is imported first in a process of its own (tests/jobs/import_first_job.py)."""
    result = run_job([sys.executable, "tests/jobs/import_first_job.py", *LIGHTNING_LAYER], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(answers) == LIGHTNING_LAYER
    failures = {module: answer[-1500:] for module, answer in answers.items() if answer != "True"}
    assert not failures, "\n".join(f"{module}: {answer}" for module, answer in failures.items())
