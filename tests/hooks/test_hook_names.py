"""One naming rule for hooks (settings every rank compares, errors, progress records): no addresses."""

from __future__ import annotations

import functools
from typing import Any

from lightning_ddpx.engine.transport.transports import hook_name
from lightning_ddpx.hooks import allreduce_hook


class CallableHook:
    def __call__(self, state: Any, bucket: Any) -> Any:
        return allreduce_hook(state, bucket)

    def method(self, state: Any, bucket: Any) -> Any:
        return allreduce_hook(state, bucket)


def test_every_kind_of_hook_is_named_without_an_address() -> None:
    names = {
        "function": hook_name(allreduce_hook),
        "partial": hook_name(functools.partial(allreduce_hook)),
        "object": hook_name(CallableHook()),
        "bound method": hook_name(CallableHook().method),
        "lambda": hook_name(lambda state, bucket: allreduce_hook(state, bucket)),
    }
    assert names["function"] == "lightning_ddpx.hooks.default.allreduce_hook"
    assert names["partial"] == "functools.partial(lightning_ddpx.hooks.default.allreduce_hook)"
    assert names["object"] == f"{__name__}.CallableHook"
    assert names["bound method"] == f"{__name__}.CallableHook.method"
    assert names["lambda"].endswith("<lambda>")
    assert not [kind for kind, name in names.items() if "0x" in name]
