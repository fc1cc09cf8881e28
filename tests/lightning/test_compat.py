"""Private torch and Lightning names live in lightning_ddpx/_compat/ only: each is importable on the
installed versions (this test imports and exercises them), and no other module names one (this test scans)."""

from __future__ import annotations

import ast
import datetime
import inspect
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_ddpx._compat import torch as torch_compat
from lightning_ddpx.lightning import _compat as lightning_compat

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_ddpx"
DEPENDENCIES = ("torch", "lightning")


@pytest.mark.parametrize("module", [torch_compat, lightning_compat], ids=["torch", "lightning"])
def test_every_name_resolves(module: object) -> None:
    for name in module.__all__:
        assert getattr(module, name) is not None, name


def test_torch_names_work() -> None:
    a, b = [torch.ones(3), torch.ones(2)], [torch.full((3,), 2.0), torch.full((2,), 3.0)]
    torch_compat.foreach_add_(a, b)
    torch_compat.foreach_sub_(a, [torch.ones(3), torch.ones(2)])
    torch_compat.foreach_copy_(b, a)
    assert [t.tolist() for t in b] == [[2.0, 2.0, 2.0], [3.0, 3.0]]
    assert torch_compat.profiler_enabled() is False
    assert torch_compat.JoinConfig.construct_disabled_join_config().enable is False
    assert torch_compat.is_fake(torch.ones(1)) is False
    assert isinstance(torch_compat.aot_compiles(), int)
    assert torch_compat.tracing_context() is None
    assert callable(torch_compat.lookup_backend("eager"))
    fake_mode = torch_compat.fake_mode_of_current_trace()
    with torch_compat.allow_non_fake_inputs(fake_mode):
        assert fake_mode.allow_non_fake_inputs is True
    assert fake_mode.allow_non_fake_inputs is False
    ran = []

    def after_backward() -> None:
        ran.append(True)

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: torch_compat.queue_backward_callback(after_backward))
    y.sum().backward()
    assert ran == [True]


def test_c10d_names_work(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=77))
    try:
        group = dist.group.WORLD
        assert torch_compat.group_timeout(group) == datetime.timedelta(seconds=77)
        assert torch_compat.rank_not_in_group(group) is False
        assert torch_compat.process_group_store(group) is not None
        assert torch_compat.default_store() is not None
    finally:
        dist.destroy_process_group()


def test_lightning_names_work() -> None:
    from lightning.pytorch import LightningModule

    from lightning_ddpx.lightning.strategies.trainer import DDPXStrategy

    module = LightningModule()
    assert lightning_compat.trainer_of(module) is None
    assert lightning_compat.compiler_context(module) is None
    assert lightning_compat.layer_sync(DDPXStrategy()) is None
    assert lightning_compat.is_local_path("/tmp/x.ckpt") and not lightning_compat.is_local_path("s3://b/x")
    assert lightning_compat.weights_only_argument(None) == {}
    assert lightning_compat.weights_only_argument(True) == {"weights_only": True}


def _private_uses(tree: ast.AST) -> list[str]:
    """Private names of torch/Lightning: imported (``from torch.x import _y``, ``from torch._x import y``) or
    reached as an attribute chain rooted at the module (``torch._foreach_copy_``, ``dist._rank_...``)."""
    found = []
    aliases = {"dist": "torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in DEPENDENCIES:
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [
                f"from {node.module} import {a.name}"
                for a in node.names
                if any(p.startswith("_") for p in parts[: -len(node.names)] + [a.name])
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and (root.id in DEPENDENCIES or root.id in aliases):
                found.append(ast.unparse(node))
    return found


def test_no_private_name_outside_compat() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_compat" in path.parts or path.stem == "_compat":
            continue
        uses = _private_uses(ast.parse(path.read_text()))
        offenders += [f"{path.relative_to(PACKAGE.parent)}: {use}" for use in uses]
    assert not offenders, "route these through lightning_ddpx/_compat/:\n" + "\n".join(offenders)


def test_the_scan_finds_private_names() -> None:
    """Guards the scan itself: it must see each form it looks for."""
    code = (
        "import torch\nimport torch.distributed as dist\nfrom torch._dynamo import x\n"
        "from lightning.fabric.utilities.types import _PATH\n"
        "torch._foreach_copy_(a, b)\ndist._rank_not_in_group(g)\ntorch.autograd.Variable._execution_engine\n"
    )
    assert len(_private_uses(ast.parse(code))) == 5


def test_optimizer_and_module_attributes_work() -> None:
    """The attributes torch's optimizers, LR schedulers, optimizers in backward and DDP's ignore list keep on
    the objects themselves, read and set through _compat."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert torch_compat.has_step_hooks(optimizer) is False
    handle = optimizer.register_step_post_hook(lambda *args: None)
    assert torch_compat.has_step_hooks(optimizer) is True
    handle.remove()
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    handle = optimizer.register_step_pre_hook(lambda *args: None)
    torch_compat.without_step_hooks(view)
    assert torch_compat.has_step_hooks(view) is False and torch_compat.has_step_hooks(optimizer) is True
    handle.remove()

    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    torch_compat.mark_stepped_for_lr_scheduler(optimizer)  # else scheduler.step() warns it ran first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()

    module = torch.nn.Linear(2, 2)
    assert torch_compat.params_and_buffers_to_ignore(module) == set()
    torch_compat.set_params_and_buffers_to_ignore(module, ["bias"])
    assert torch_compat.params_and_buffers_to_ignore(module) == {"bias"}
    assert torch_compat.in_backward_optimizers(module.weight) == []
    _apply_optimizer_in_backward(torch.optim.SGD, [module.weight], {"lr": 0.1})
    try:
        assert len(torch_compat.in_backward_optimizers(module.weight)) == 1
    finally:  # other tests count torch's registrations: leave none behind
        handles = sys.modules[
            "torch.distributed.optim.apply_optimizer_in_backward"
        ].param_to_optim_hook_handle_map
        for handle in handles.pop(module.weight, []):
            handle.remove()


def test_lightning_wrapper_attributes_work() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision as LightningPrecision

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert lightning_compat.unwrapped_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert lightning_compat.unwrapped_optimizer(optimizer) is optimizer
    module = torch.nn.Linear(2, 2)
    assert lightning_compat.forward_module(module) is module
    ran = []

    class Precision:
        def _wrap_closure(self, model: object, optimizer: object, closure: Any) -> Any:
            return closure()

    assert lightning_compat.wrap_closure(Precision(), None, optimizer, lambda: ran.append(1) or 7) == 7
    assert ran == [1]
    wrapped = inspect.signature(LightningPrecision._wrap_closure).parameters  # what wrap_closure calls
    assert list(wrapped) == ["self", "model", "optimizer", "closure"]
