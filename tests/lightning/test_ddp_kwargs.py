"""Lightning's DDPStrategy arguments and torch's DDP keyword arguments on both DDPX strategies (one process).

Every keyword argument of ``torch.nn.parallel.DistributedDataParallel.__init__`` must be either a named
argument of the strategies (honoured, with torch's meaning) or refused with an error naming it and the fix:
the first test fails when a new torch release adds an argument nobody decided about. What the honoured
ones do in training is tested with two processes in test_ddp_features.py and test_static_graph.py.
"""

from __future__ import annotations

import inspect
import sys
import warnings

import pytest
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_ddpx import DDPXStrategy
from lightning_ddpx.hooks import fp16_compress_wrapper
from lightning_ddpx.lightning.settings.ddp_kwargs import HONOURED, REFUSED, wrapper_name
from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPXStrategy

STRATEGIES = [DDPXStrategy, FabricDDPXStrategy]
TORCH_DDP_ARGUMENTS = [
    name for name in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    if name not in ("self", "module")
]  # fmt: skip
LIGHTNING_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")


@pytest.mark.parametrize("strategy, lightning_strategy", [
    (DDPXStrategy, DDPStrategy), (FabricDDPXStrategy, FabricDDPStrategy)
])  # fmt: skip
def test_every_lightning_ddp_strategy_argument_is_accepted(strategy, lightning_strategy):
    ours = inspect.signature(strategy.__init__).parameters
    lightning = set(inspect.signature(lightning_strategy.__init__).parameters) | set(LIGHTNING_HOOK_ARGUMENTS)
    assert lightning <= set(ours)  # model_averaging_period included (Fabric's DDPStrategy lacks it)
    assert ours["kwargs"].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("name", TORCH_DDP_ARGUMENTS)
def test_every_torch_ddp_argument_is_decided(name):
    """Honoured ones are named, typed arguments of both strategies (LightningCLI reads them); the others
    are refused (or, for check_reduction, a deprecated no-op as in torch)."""
    if name in HONOURED:
        for strategy in STRATEGIES:
            assert name in inspect.signature(strategy.__init__).parameters, (strategy, name)
    else:
        assert name in REFUSED or name == "check_reduction", name


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name, value", [
    ("device_ids", [0]), ("output_device", 0), ("dim", 1), ("process_group", object()),
    ("delay_all_reduce_named_params", [("w", torch.nn.Parameter(torch.ones(1)))]),
    ("param_to_hook_all_reduce", torch.nn.Parameter(torch.ones(1))), ("mixed_precision", object()),
    ("device_mesh", object()), ("bucket_cap_mb_list", [1, 25]),
])  # fmt: skip
def test_refused_torch_arguments_name_themselves_and_the_fix(strategy, name, value):
    with pytest.raises(ValueError, match=rf"torch DDP argument {name}=.* is not supported: .*") as error:
        strategy(**{name: value})
    message = str(error.value)
    assert any(word in message for word in ("Remove", "Use", "pass", "use")), message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_refused_arguments_at_torchs_default_are_harmless(strategy):
    defaults = {name: default for name, (default, _) in REFUSED.items()}
    strategy(**defaults)  # what a config file written for "ddp" with explicit defaults holds


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unknown_argument_is_a_type_error_with_a_suggestion(strategy):
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'static_grap'\. Did you mean 'static_graph'"
    ):
        strategy(static_grap=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_check_reduction_warns_like_torch(strategy):
    with pytest.warns(FutureWarning, match="check_reduction=True has no effect"):
        strategy(check_reduction=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy(check_reduction=False)


TRUE_FALSE_OPTIONS = [
    "find_unused_parameters", "broadcast_buffers", "gradient_as_bucket_view", "static_graph", "init_sync",
    "forward_sync_buffers", "skip_all_reduce_unused_params", "batched_grad_copy", "check_reduction",
]  # fmt: skip


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", TRUE_FALSE_OPTIONS)
@pytest.mark.parametrize("value", ["False", 0, 1.0])
def test_true_false_options_refuse_other_values_by_name(strategy, name, value):
    """``"False"`` would count as true: every True/False option of torch's DDP the strategies take is checked
    to be a bool (``forward_sync_buffers`` may also be None, torch's default)."""
    with pytest.raises(TypeError, match=rf"{name} must be True(, False or None| or False), got {value!r}"):
        strategy(**{name: value})
    strategy(**{name: name != "check_reduction"})  # a bool passes (check_reduction=True would warn)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_broadcast_buffers_none_is_torchs_default(strategy):
    """torch 2.13's DDP defaults broadcast_buffers to None (True unless forward_sync_buffers says otherwise)."""
    assert strategy(broadcast_buffers=None).ddpx_config.broadcast_buffers is True
    assert strategy(broadcast_buffers=None, forward_sync_buffers=False).ddpx_config.broadcast_buffers is False


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_honoured_arguments_reach_the_config(strategy):
    s = strategy(static_graph=True, init_sync=False, forward_sync_buffers=False, skip_all_reduce_unused_params=True,
                 batched_grad_copy=True)  # fmt: skip
    config = s.ddpx_config
    assert (config.static_graph, config.init_sync, config.broadcast_buffers) == (True, False, False)
    assert (s.static_graph, s.init_sync) == (True, False)
    assert strategy(forward_sync_buffers=True).broadcast_buffers is True
    with pytest.raises(ValueError, match="broadcast_buffers=False and forward_sync_buffers=True contradict"):
        strategy(broadcast_buffers=False, forward_sync_buffers=True)
    with pytest.raises(TypeError, match="batched_grad_copy must be True or False"):
        strategy(batched_grad_copy="yes")


# ------------------------------------------------------------------------------ Lightning's hook names
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ours, theirs, value", [
    ("comm_hook", "ddp_comm_hook", default_hooks.allreduce_hook),
    ("comm_state", "ddp_comm_state", object()),
    ("comm_wrapper", "ddp_comm_wrapper", "fp16"),
])  # fmt: skip
def test_both_spellings_of_one_option_is_an_error(strategy, ours, theirs, value):
    arguments = {ours: value, theirs: value, "comm_hook": default_hooks.allreduce_hook}
    if ours == "comm_hook":
        arguments = {ours: value, theirs: value}
    with pytest.raises(ValueError, match=f"both {ours} and {theirs} are given.*pass only one"):
        strategy(**arguments)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_hook_and_state_are_used_as_given(strategy):
    state = object()
    s = strategy(ddp_comm_hook=default_hooks.fp16_compress_hook, ddp_comm_state=state)
    assert (
        s.comm_hook is default_hooks.fp16_compress_hook and s.comm_state is state and s.comm_wrapper is None
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("wrapper, name", [
    (default_hooks.fp16_compress_wrapper, "fp16"), (default_hooks.bf16_compress_wrapper, "bf16"),
    (fp16_compress_wrapper, "fp16"), ("bf16", "bf16"),
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_wrapper", "fp16"),
])  # fmt: skip
def test_torch_compression_wrappers_become_ours(strategy, wrapper, name):
    """torch's wrappers map to ours, so they also wrap named hooks (PowerSGD), on every device."""
    s = strategy(ddp_comm_hook="powersgd", ddp_comm_wrapper=wrapper)
    assert (s.comm_hook, s.comm_wrapper, s.hook_name) == ("powersgd", name, f"{name}(powersgd)")
    assert wrapper_name(wrapper) == name


def test_another_wrapper_is_applied_to_the_callable_hook_as_lightning_does():
    calls = []

    def logging_wrapper(hook):
        def wrapped(state, bucket):
            calls.append(bucket)
            return hook(state, bucket)

        return wrapped

    s = DDPXStrategy(ddp_comm_hook=default_hooks.allreduce_hook, ddp_comm_wrapper=logging_wrapper)
    assert s.comm_hook.__qualname__.startswith("test_another_wrapper") and s.comm_wrapper is None
    with pytest.raises(
        ValueError,
        match="ddp_comm_wrapper=.*logging_wrapper.* wraps a callable hook, but the hook is 'powersgd'",
    ):
        DDPXStrategy(ddp_comm_hook="powersgd", ddp_comm_wrapper=logging_wrapper)
    with pytest.raises(TypeError, match="ddp_comm_wrapper must be a hook wrapper"):
        DDPXStrategy(ddp_comm_hook=default_hooks.allreduce_hook, ddp_comm_wrapper=3)


# ------------------------------------------------------------------------------------------- the CLI
def test_lightning_cli_reads_torch_and_lightning_arguments(monkeypatch):
    """``--trainer.strategy.static_graph=true`` and Lightning's hook names work from the command line."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["cli"])
    cli = LightningCLI(
        LightningModule,
        run=False,
        save_config_callback=None,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.strategy=lightning_ddpx.DDPXStrategy",
            "--trainer.strategy.static_graph=true",
            "--trainer.strategy.init_sync=false",
            "--trainer.strategy.ddp_comm_hook=torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook",
            "--trainer.strategy.ddp_comm_wrapper=bf16",
        ],
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DDPXStrategy)
    assert strategy.static_graph is True and strategy.init_sync is False
    assert strategy.comm_hook is default_hooks.allreduce_hook and strategy.comm_wrapper == "bf16"
