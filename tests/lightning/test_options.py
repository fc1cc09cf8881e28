"""Each strategy option is declared once (lightning_ddpx/lightning/settings/options.py): the strategies' signatures,
docstrings, read-back attributes and the docs tables all follow from the declarations, and these tests fail
when any of them disagrees with the config."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ddpx.lightning.settings.config import DDPXConfig, DDPXConfigAttributes
from lightning_ddpx.lightning.settings.options import SPELLINGS, options_for
from lightning_ddpx.lightning.strategies import fabric
from lightning_ddpx.lightning.strategies import trainer as strategy

REPO_ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = {"Trainer": strategy.DDPXStrategy, "Fabric": fabric.DDPXStrategy}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_signature_is_the_declarations(name: str) -> None:
    parameters = inspect.signature(STRATEGIES[name].__init__).parameters
    for option in options_for(name):
        parameter = parameters[option.name]
        assert parameter.kind is parameter.KEYWORD_ONLY, option.name
        assert parameter.default == option.default, option.name
        assert parameter.annotation == option.annotation, option.name
    declared = {o.name for o in options_for(name)}
    keyword_only = {p.name for p in parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert keyword_only == declared


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_strategy_built_with_defaults_holds_the_config_defaults(name: str) -> None:
    built = STRATEGIES[name]()
    for f in dataclasses.fields(DDPXConfig):
        if name in f.metadata["strategies"]:
            assert getattr(built, f.name) == getattr(DDPXConfig(), f.name) == f.default, f.name


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_option_given_reaches_the_config(name: str) -> None:
    values = {"bucket_cap_mb": 3.5, "first_bucket_cap_mb": 0.5, "find_unused_parameters": True,
              "broadcast_buffers": False, "gradient_as_bucket_view": True, "static_graph": True,
              "init_sync": False, "uneven_inputs": "error", "comm_stats_every_n_steps": 7}  # fmt: skip
    accepted = {o.name for o in options_for(name)}
    built = STRATEGIES[name](**{k: v for k, v in values.items() if k in accepted})
    for key, value in values.items():
        if key in accepted:
            assert getattr(built.ddpx_config, key) == value == getattr(built, key), key


def test_one_read_only_attribute_per_config_field() -> None:
    for f in dataclasses.fields(DDPXConfig):
        assert f.name in DDPXConfigAttributes.__dict__, f.name
    built = strategy.DDPXStrategy(bucket_cap_mb=2)
    with pytest.raises(AttributeError, match="read-only"):
        built.bucket_cap_mb = 3


def test_fabric_lacks_only_the_trainer_only_options() -> None:
    trainer = {o.name for o in options_for("Trainer")}
    fabric_options = {o.name for o in options_for("Fabric")}
    assert trainer - fabric_options == {"comm_stats_every_n_steps"}
    with pytest.raises(
        TypeError, match="comm_stats_every_n_steps is an option of the other DDPX strategy only"
    ):
        fabric.DDPXStrategy(comm_stats_every_n_steps=2)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_docstring_documents_every_option(name: str) -> None:
    doc = STRATEGIES[name].__doc__
    for option in options_for(name):
        assert f"        {option.name}: " in doc, option.name
        assert option.doc.strip(), option.name


def test_spellings_are_not_config_fields() -> None:
    fields = {f.name for f in dataclasses.fields(DDPXConfig)}
    assert not fields & {o.name for o in SPELLINGS}


@pytest.mark.processes
def test_docs_tables_are_made_from_the_declarations() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "options_tables.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr + "\nrun: python scripts/options_tables.py"


def test_every_true_false_option_refuses_other_values_by_name() -> None:
    """A string such as ``"False"`` would count as true; every option declared ``bool`` (a new one included)
    refuses it, and 0/1, naming itself."""
    flags = [f.name for f in dataclasses.fields(DDPXConfig) if f.type in ("bool", bool)]
    assert {"find_unused_parameters", "static_graph", "overlap_optimizer", "init_sync"} <= set(flags)
    for name in flags:
        for value in ("False", 1):
            with pytest.raises(
                TypeError, match=rf"DDPXStrategy: {name} must be True or False, got {value!r}"
            ):
                DDPXConfig(**{name: value})
