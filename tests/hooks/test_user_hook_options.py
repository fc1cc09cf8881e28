"""Options for a hook of the user's own: registered once with an options type (``register_hook_name(name,
factory, options_type=...)``), given to either strategy as ``comm_hook_options`` -- from Python, a YAML file
or command-line flags -- checked by type when the strategy is built, naming the option, passed to the hook's
factory, and compared across ranks before the first step like the built-in hooks' options."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

from lightning_ddpx import DDPXStrategy
from lightning_ddpx.hooks import allreduce_hook, build_comm_hook, register_hook_name
from lightning_ddpx.lightning.settings.config import DDPXConfig
from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPXStrategy
from tests.dist_utils import REPO_ROOT, one_rank_group, run_distributed

HOOK = "test_scaled_mean"


@dataclasses.dataclass(frozen=True)
class ScaledMeanOptions:
    """The options of the test hook: what a user's own configurable hook declares."""

    factor: float = 1.0  # the mean gradient is multiplied by this
    start_step: int = 0  # plain mean before this step
    log: bool = False
    label: Optional[str] = None
    every: int | None = None  # the newer spelling of Optional


class ScaledMeanState:
    """The hook's state; it keeps the factor, not the options object, so the settings every rank compares
    see the options only through the strategy (``comm_hook_options``)."""

    def __init__(self, process_group: Any, factor: float) -> None:
        self.process_group, self.factor = process_group, factor


def scaled_mean_hook(state: ScaledMeanState, bucket: Any) -> torch.futures.Future:
    factor = state.factor
    return allreduce_hook(state.process_group, bucket).then(lambda done: done.value().mul_(factor))


def scaled_mean(process_group: Any, options: Optional[ScaledMeanOptions]) -> tuple[Any, Any]:
    return ScaledMeanState(process_group, (options or ScaledMeanOptions()).factor), scaled_mean_hook


def register_test_hooks() -> None:
    """What a user's package does at import; here per test module (and in each spawned rank), so the names do
    not leak into other tests' ``available_hooks()``."""
    register_hook_name(HOOK, scaled_mean, options_type=ScaledMeanOptions, replace=True)
    register_hook_name(
        "test_plain_mean", lambda process_group, options: (process_group, allreduce_hook), replace=True
    )


@pytest.fixture(autouse=True, scope="module")
def registered_hooks():
    from lightning_ddpx.hooks import registry

    register_test_hooks()
    yield
    for name in (HOOK, "test_plain_mean"):
        registry._REGISTRY.pop(name, None)


# ------------------------------------------------------------------------------------------ Python
@pytest.mark.parametrize("strategy_class", [DDPXStrategy, FabricDDPXStrategy], ids=["Trainer", "Fabric"])
def test_the_options_are_parsed_into_the_registered_type(strategy_class: type) -> None:
    strategy = strategy_class(comm_hook=HOOK, comm_hook_options={"factor": 0.5, "start_step": 2})
    assert strategy.comm_hook_options == ScaledMeanOptions(factor=0.5, start_step=2)
    given = ScaledMeanOptions(factor=2.0)
    assert strategy_class(comm_hook=HOOK, comm_hook_options=given).comm_hook_options is given
    assert strategy_class(comm_hook=HOOK).comm_hook_options is None  # the factory's defaults


def test_the_options_reach_the_hook() -> None:
    config = DDPXConfig(comm_hook=HOOK, comm_hook_options={"factor": 0.5})
    with one_rank_group():
        module = config.wrap(nn.Linear(3, 1, bias=False))
        state = config.register_hook(module)
        assert isinstance(state, ScaledMeanState) and state.factor == 0.5
        assert module.driver_settings["comm_hook_options"] == repr(ScaledMeanOptions(factor=0.5))
        inputs = torch.ones(2, 3)
        module(inputs).sum().backward()
        torch.testing.assert_close(module.module.weight.grad, 0.5 * inputs.sum(0, keepdim=True))
        module.close()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (
            {"factor": "0.5"},
            TypeError,
            r"ScaledMeanOptions: factor must be a finite number, got '0.5' \(str\)",
        ),
        ({"factor": float("nan")}, TypeError, "factor must be a finite number"),
        (
            {"start_step": 1.5},
            TypeError,
            r"ScaledMeanOptions: start_step must be an integer, got 1.5 \(float\)",
        ),
        ({"start_step": True}, TypeError, "start_step must be an integer, got True"),
        ({"log": "false"}, TypeError, "ScaledMeanOptions: log must be True or False, got 'false'"),
        ({"label": 3}, TypeError, r"ScaledMeanOptions: label must be a string, got 3 \(int\)"),
        ({"every": "2"}, TypeError, r"ScaledMeanOptions: every must be an integer, got '2' \(str\)"),
        ({"factr": 0.5}, TypeError, r"unknown options option\(s\) \['factr'\] for hook 'test_scaled_mean'"),
        ([0.5], TypeError, "options must be a ScaledMeanOptions or a dict of its fields, got list"),
    ],
)
def test_bad_options_fail_in_the_constructor_naming_the_option(options: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match) as raised:
        DDPXStrategy(comm_hook=HOOK, comm_hook_options=options)
    assert str(raised.value).startswith(f"DDPXStrategy: comm_hook_options={options!r}: ")
    with pytest.raises(error, match=match):  # the registry checks the same when used without a strategy
        build_comm_hook(HOOK, options=options)


def test_none_stays_allowed_for_an_optional_field() -> None:
    options = DDPXConfig(comm_hook=HOOK, comm_hook_options={"label": None, "every": None}).comm_hook_options
    assert options.label is None and options.every is None


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        (
            {"comm_hook": "powersgd", "comm_hook_options": {"factor": 0.5}},
            r"comm_hook is 'powersgd', which takes no comm_hook_options \(its own go in powersgd=\.\.\.\)\. "
            r"Set comm_hook(=| to one of \[.*)'test_scaled_mean'",  # the registered hooks that take them
        ),
        (
            {"comm_hook": "test_plain_mean", "comm_hook_options": {"factor": 0.5}},
            "comm_hook is 'test_plain_mean', which takes none",
        ),
        ({"comm_hook_options": {"factor": 0.5}}, "comm_hook is None, which takes none"),
        (
            {"comm_hook": allreduce_hook, "comm_hook_options": {"factor": 0.5}},
            r"comm_hook is the callable lightning_ddpx.hooks.default.allreduce_hook.*comm_state.*register_hook_name",
        ),
        (
            {"comm_hook": HOOK, "powersgd": {"matrix_approximation_rank": 2}},
            r"which takes no powersgd options \(its own go in comm_hook_options=\.\.\.\)",
        ),
        ({"comm_hook": HOOK, "comm_state": object()}, r"configure it through comm_hook_options=\.\.\."),
    ],
)
def test_options_and_hook_must_belong_together(arguments: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DDPXStrategy(**arguments)


# ------------------------------------------------------------------------- YAML and command line
@pytest.fixture(scope="module")
def cli_train():
    script_dir = REPO_ROOT / "examples"
    sys.path.insert(0, str(script_dir))
    try:
        import cli_train
    finally:
        sys.path.remove(str(script_dir))
    return cli_train


def _parsed_strategy(cli_train: Any, arguments: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", [str(REPO_ROOT / "examples" / "cli_train.py")])
    cli = LightningCLI(
        cli_train.DigitsClassifier,
        cli_train.DigitsDataModule,
        run=False,
        args=arguments,
        save_config_callback=None,
    )
    return cli.trainer.strategy


def _config_file(tmp_path: Path, options: str) -> Path:
    path = tmp_path / "scaled_mean.yaml"
    path.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  strategy:\n"
        "    class_path: lightning_ddpx.DDPXStrategy\n"
        "    init_args:\n"
        f"      comm_hook: {HOOK}\n"
        "      comm_hook_options:\n"
        f"{options}"
    )
    return path


def test_yaml_file_gives_the_options(cli_train, tmp_path, monkeypatch) -> None:
    config = _config_file(tmp_path, "        factor: 0.25\n        start_step: 10\n")
    strategy = _parsed_strategy(cli_train, ["--config", str(config)], monkeypatch)
    assert isinstance(strategy, DDPXStrategy)
    assert strategy.comm_hook == HOOK and strategy.hook_name == HOOK
    assert strategy.comm_hook_options == ScaledMeanOptions(factor=0.25, start_step=10)


def test_command_line_flags_give_the_options(cli_train, monkeypatch) -> None:
    flags = [
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.strategy=lightning_ddpx.DDPXStrategy",
        f"--trainer.strategy.comm_hook={HOOK}",
        "--trainer.strategy.comm_hook_options.factor=0.75",
        "--trainer.strategy.comm_hook_options.log=true",
    ]
    strategy = _parsed_strategy(cli_train, flags, monkeypatch)
    assert strategy.comm_hook_options == ScaledMeanOptions(factor=0.75, log=True)
    as_json = [*flags[:4], '--trainer.strategy.comm_hook_options={"start_step": 3}']
    assert _parsed_strategy(cli_train, as_json, monkeypatch).comm_hook_options == ScaledMeanOptions(
        start_step=3
    )


def test_a_quoted_yaml_value_is_refused_naming_the_option(cli_train, tmp_path, monkeypatch) -> None:
    config = _config_file(tmp_path, '        factor: "a half"\n')
    with pytest.raises(ValueError) as raised:  # jsonargparse's error, carrying ours
        _parsed_strategy(cli_train, ["--config", str(config)], monkeypatch)
    expected = "comm_hook_options={'factor': 'a half'}: ScaledMeanOptions: factor must be a finite number"
    assert expected in str(raised.value), str(raised.value)


# ------------------------------------------------------------------------------------- every rank
def built_with_options(rank: int, world_size: int, factors: list[float]) -> dict:
    register_test_hooks()  # a fresh process: as the user's package, imported on every rank
    config = DDPXConfig(comm_hook=HOOK, comm_hook_options={"factor": factors[rank]})
    module = config.wrap(nn.Linear(3, 1))
    config.register_hook(module)
    try:
        module(torch.ones(2, 3) * (rank + 1)).sum().backward()
    except ValueError as error:
        return {"raised": True, "message": str(error)}
    return {"raised": False, "grad": module.module.weight.grad.clone()}


@pytest.mark.slow
@pytest.mark.processes
def test_ranks_given_different_options_fail_before_the_first_step() -> None:
    results = run_distributed(built_with_options, 2, [0.5, 1.0], pg_timeout=6.0, timeout=120)
    for result in results:
        assert result["raised"], result
        assert "Setting 'comm_hook_options' differs" in result["message"], result["message"]
        assert "factor=0.5" in result["message"] and "factor=1.0" in result["message"], result["message"]


@pytest.mark.slow
@pytest.mark.processes
def test_ranks_given_the_same_options_train_with_them() -> None:
    results = run_distributed(built_with_options, 2, [0.5, 0.5], pg_timeout=6.0, timeout=120)
    expected = 0.5 * torch.full((1, 3), 2.0 * (1 + 2) / 2)  # half the mean over ranks of 2 rows of (rank + 1)
    for result in results:
        assert not result["raised"], result
        torch.testing.assert_close(result["grad"], expected)
