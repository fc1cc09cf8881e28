"""torch's DDP API on our class: constructor arguments, pickling and copying, errors, ``_set_static_graph``.

Oracle style: each case runs the same call on torch's ``DistributedDataParallel`` and on ours, and expects
the same outcome (the same value, the same error type with torch's sentence inside our message, the same
warning category), or, for training, the same parameters after the same steps.
"""

# No ``from __future__ import annotations``: torch's DDP reads the hooks' annotations as objects (it refuses
# annotations left as strings, which ours accepts: test_string_annotations_are_accepted).
import copy
import inspect
import io
import re
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from lightning_ddpx._compat.torch import inputs_to_device
from lightning_ddpx.engine.module.placement import resolve_placement
from tests.dist_utils import one_rank_group, run_distributed
from tests.engine.test_engine_oracle import conv_bn, conv_loss, mlp, mlp_loss
from tests.oracle import assert_same_tensors, rank_batch, train_side_by_side

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
OUR_DDP = lightning_ddpx.DistributedDataParallel


def outcome(build: Callable[[], Any]) -> tuple[str, str, list[str]]:
    """(error type or "ok", error text, warning categories) of ``build()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            build()
        except Exception as error:  # noqa: BLE001 - the outcome is what is compared
            return type(error).__name__, str(error), [w.category.__name__ for w in caught]
    return "ok", "", [w.category.__name__ for w in caught]


def torch_sentence(text: str) -> str:
    """torch's message without its C++ stack or logging prefix: what tests written for torch match."""
    return text.split("\nException raised from")[0].strip()


# --------------------------------------------------------------------------------- constructor (1 rank)
CONSTRUCTOR_CASES = {
    "device_ids_none": {"device_ids": None},
    "device_ids_empty": {"device_ids": []},
    "device_ids_cpu_module": {"device_ids": [0]},
    "device_ids_two": {"device_ids": [0, 1]},
    "output_device_cpu_module": {"output_device": 1},
    "output_device_zero": {"output_device": 0},  # falsy: torch lets it pass, so do we
    "dim": {"dim": 1},
    "check_reduction": {"check_reduction": True},
    "bucket_cap_mb_none": {"bucket_cap_mb": None},
    "forward_sync_buffers_off": {"forward_sync_buffers": False},
    "forward_sync_buffers_on": {"forward_sync_buffers": True},
    "broadcast_buffers_off": {"broadcast_buffers": False},  # deprecated by torch 2.13: it warns
    "broadcast_buffers_on": {"broadcast_buffers": True},
    "broadcast_and_forward_sync_buffers": {"broadcast_buffers": False, "forward_sync_buffers": True},
    "skip_all_reduce_unused_params": {"skip_all_reduce_unused_params": True},
    "batched_grad_copy": {"batched_grad_copy": True},
}
ATTRIBUTES = (
    "device_ids", "output_device", "dim", "forward_sync_buffers", "broadcast_buffers",
    "skip_all_reduce_unused_params", "batched_grad_copy",
)  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONSTRUCTOR_CASES))
def test_constructor_arguments_behave_as_torchs(name: str) -> None:
    kwargs = CONSTRUCTOR_CASES[name]
    with one_rank_group():
        made: dict[str, Any] = {}
        theirs = outcome(lambda: made.__setitem__("torch", TORCH_DDP(nn.Linear(3, 2), **kwargs)))
        ours = outcome(lambda: made.__setitem__("ours", OUR_DDP(nn.Linear(3, 2), **kwargs)))
    assert ours[0] == theirs[0], f"ours: {ours}, torch's: {theirs}"
    assert torch_sentence(theirs[1]) in ours[1]
    assert ("FutureWarning" in ours[2]) == ("FutureWarning" in theirs[2]) or name == "bucket_cap_mb_none"
    if theirs[0] == "ok":
        for attribute in ATTRIBUTES:
            assert getattr(made["ours"], attribute) == getattr(made["torch"], attribute), attribute


def test_find_unused_with_a_static_graph_warns_as_torch_warns() -> None:
    kwargs = {"static_graph": True, "find_unused_parameters": True}
    with one_rank_group():
        theirs, ours = (
            outcome(lambda cls=cls: cls(nn.Linear(3, 2), **kwargs)) for cls in (TORCH_DDP, OUR_DDP)
        )
        with pytest.warns(
            UserWarning, match="`_set_static_graph` will detect unused parameters automatically"
        ):
            OUR_DDP(nn.Linear(3, 2), **kwargs)
    assert theirs[2] == ours[2] == ["UserWarning"]


def test_find_unused_with_nothing_unused_warns_once_as_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_ddpx.engine.reducer.reachability as graph

    monkeypatch.setattr(graph, "_warned_nothing_unused", False)
    with one_rank_group():
        model = OUR_DDP(nn.Linear(3, 2), find_unused_parameters=True)
        with pytest.warns(UserWarning, match="did not find any unused parameters in the forward pass"):
            model(torch.ones(1, 3)).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(torch.ones(1, 3)).sum().backward()  # once per process, as torch's TORCH_WARN_ONCE


def test_positional_arguments_follow_torchs_order() -> None:
    with one_rank_group():
        model = OUR_DDP(nn.Linear(3, 2), None, None, 0, True, True, None, 5.0, False, False, False, True)
        assert (model.bucket_cap_mb, model.static_graph, model.device_ids) == (5.0, True, None)


def test_device_ids_name_the_modules_gpu() -> None:
    """The GPU rules without a GPU: the placement is decided from the module's device alone."""
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert resolve_placement([1], None, cuda1) == ([1], 1, cuda1)
    assert resolve_placement([torch.device("cuda:1")], 0, cuda1) == ([1], 0, cuda1)
    assert resolve_placement(None, None, cuda1) == (None, None, None)
    with pytest.raises(
        ValueError, match=r"device_ids=\[1\] names cuda:1, but the module's parameters are on cuda:0"
    ):
        resolve_placement([1], None, cuda0)
    with pytest.raises(ValueError, match="device_ids can only be None or contain a single element."):
        resolve_placement([0, 1], None, cuda0)


def test_inputs_move_to_the_device_in_their_structures() -> None:
    """forward's move (torch's own function): tensors inside tuples, dicts and lists, others untouched."""
    point = torch.ones(2)
    args, kwargs = inputs_to_device(
        (point, [point, 3]), {"x": {"y": point}, "n": "text"}, torch.device("meta"), False
    )
    assert args[0].device.type == "meta" and args[1][0].device.type == "meta" and args[1][1] == 3
    assert kwargs["x"]["y"].device.type == "meta" and kwargs["n"] == "text"
    assert inputs_to_device((), {}, torch.device("meta"), False) == ((), {})


# ------------------------------------------------------------------------------------- errors (1 rank)
def _no_grad_module() -> nn.Module:
    return nn.Linear(3, 2).requires_grad_(False)


@pytest.mark.parametrize("build", [nn.Module, _no_grad_module], ids=["no_parameters", "all_frozen"])
def test_nothing_to_synchronise_is_a_runtime_error_as_in_torch(build: Callable[[], nn.Module]) -> None:
    with one_rank_group():
        theirs = outcome(lambda: TORCH_DDP(build()))
        with pytest.raises(RuntimeError) as ours:
            OUR_DDP(build())
    assert theirs[0] == "RuntimeError"
    assert isinstance(ours.value, ValueError)  # what earlier releases raised: callers catching it still do
    assert torch_sentence(theirs[1]) in str(ours.value)


def _hook_returning_int(state: object, bucket: dist.GradBucket) -> int:
    return 0


def _hook_taking_int(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future()


def _good_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


BAD_HOOKS = {
    "not_callable": 1,
    "bucket_annotation": _hook_taking_int,
    "return_annotation": _hook_returning_int,
}


@pytest.mark.parametrize("name", sorted(BAD_HOOKS))
def test_bad_hooks_are_refused_as_torch_refuses_them(name: str) -> None:
    hook = BAD_HOOKS[name]
    with one_rank_group():
        theirs = outcome(lambda: TORCH_DDP(nn.Linear(3, 2)).register_comm_hook(None, hook))
        ours = outcome(lambda: OUR_DDP(nn.Linear(3, 2)).register_comm_hook(None, hook))
    assert theirs[0] != "ok" and ours[0] == theirs[0], f"ours: {ours}, torch's: {theirs}"
    assert torch_sentence(theirs[1]) in ours[1]


def test_a_hook_is_registered_once_with_torchs_sentence() -> None:
    def twice(ddp_class: type) -> tuple[str, str, list[str]]:
        model = ddp_class(nn.Linear(3, 2))
        model.register_comm_hook(None, _good_hook)
        return outcome(lambda: model.register_comm_hook(None, _good_hook))

    with one_rank_group():
        theirs, ours = twice(TORCH_DDP), twice(OUR_DDP)
    assert ours[0] == theirs[0] == "RuntimeError"
    assert torch_sentence(theirs[1]) in ours[1]
    assert re.search("register_comm_hook can only be called once.", ours[1])  # older torch's sentence


def _returns_int(state: object, bucket: dist.GradBucket):  # noqa: ANN202 - unannotated, as users write them
    return 1


def _returns_tensor(state: object, bucket: dist.GradBucket):  # noqa: ANN202
    return bucket.buffer()


def _returns_none(state: object, bucket: dist.GradBucket):  # noqa: ANN202
    return None


NOT_A_FUTURE = {"int": _returns_int, "tensor": _returns_tensor}  # torch 2.13 crashes (SIGSEGV) on None
TORCH_NOT_A_FUTURE = re.compile(r"callback must return a torch\.futures\.Future object, but got \S+")


@pytest.mark.parametrize("name", sorted(NOT_A_FUTURE))
def test_a_hook_returning_no_future_fails_backward_with_torchs_sentence(name: str) -> None:
    """An unannotated hook passes registration; torch's backward then refuses its result with a
    RuntimeError naming the type it got. Ours raises the same type and sentence, naming the hook too."""
    hook = NOT_A_FUTURE[name]

    def backward(ddp_class: type) -> tuple[str, str, list[str]]:
        model = ddp_class(nn.Linear(3, 2))
        model.register_comm_hook(None, hook)
        return outcome(lambda: model(torch.randn(4, 3)).sum().backward())

    with one_rank_group():
        theirs = backward(TORCH_DDP)
    with one_rank_group():
        ours = backward(OUR_DDP)
    sentence = TORCH_NOT_A_FUTURE.search(theirs[1])
    assert theirs[0] == "RuntimeError" and sentence, f"torch's behaviour changed: {theirs}"
    assert ours[0] == "RuntimeError" and sentence.group(0) in ours[1], f"ours: {ours}, torch's: {theirs}"
    assert hook.__qualname__ in ours[1]  # the culprit, which torch's message does not name


def test_a_hook_returning_none_fails_backward_in_torchs_words() -> None:
    """No oracle here: torch 2.13's backward segfaults on a hook returning None. Ours raises its error."""
    with one_rank_group():
        model = OUR_DDP(nn.Linear(3, 2))
        model.register_comm_hook(None, _returns_none)
        with pytest.raises(RuntimeError, match="_returns_none") as raised:
            model(torch.randn(4, 3)).sum().backward()
    sentence = "callback must return a torch.futures.Future object, but got builtins.NoneType"
    assert sentence in str(raised.value)


def test_string_annotations_are_accepted() -> None:
    """``from __future__ import annotations`` leaves annotations as strings: a correct hook stays correct."""

    def hook(state: "object", bucket: "dist.GradBucket") -> "torch.futures.Future[torch.Tensor]":
        return _good_hook(state, bucket)

    with one_rank_group():
        OUR_DDP(nn.Linear(3, 2)).register_comm_hook(None, hook)


def _train_one_step(model: nn.Module) -> None:
    model(torch.randn(4, 3)).sum().backward()


def test_set_static_graph_as_torchs() -> None:
    def after_training(ddp_class: type) -> tuple[str, str, list[str]]:
        model = ddp_class(nn.Linear(3, 2))
        _train_one_step(model)
        return outcome(model._set_static_graph)

    def twice(ddp_class: type) -> tuple[str, str, list[str]]:
        model = ddp_class(nn.Linear(3, 2))
        model._set_static_graph()
        return outcome(model._set_static_graph)

    def after_forward(ddp_class: type) -> tuple[str, str, list[str]]:
        model = ddp_class(nn.Linear(3, 2))
        model(torch.randn(4, 3))  # a synchronising forward, no backward yet
        return outcome(model._set_static_graph)

    with one_rank_group():
        late = after_training(TORCH_DDP), after_training(OUR_DDP)
        again = twice(TORCH_DDP), twice(OUR_DDP)
        forward_only = after_forward(TORCH_DDP), after_forward(OUR_DDP)
        made_static = OUR_DDP(nn.Linear(3, 2))
        made_static._set_static_graph()
        assert made_static.static_graph and made_static.reducer.static_graph
        assert made_static.settings()["static_graph"] == "True"  # compared across ranks like the argument
    assert late[0][0] == late[1][0] == "RuntimeError"
    assert "should be called before training loop starts" in late[0][1]
    assert "should be called before training loop starts" in late[1][1]
    assert again[0][0] == again[1][0] == "ok" and again[0][2] == again[1][2] == ["UserWarning"]
    assert forward_only[0][0] == forward_only[1][0] == "RuntimeError"


def buffers_stay_local(rank: int, world_size: int) -> None:
    """forward_sync_buffers=False: each rank keeps its own BatchNorm statistics, as with torch's DDP."""
    kwargs = {"forward_sync_buffers": False}
    train_side_by_side(rank, conv_bn, conv_loss, 3, {**kwargs, "bucket_cap_mb": 0.004}, kwargs)


@pytest.mark.slow
@pytest.mark.processes
def test_forward_sync_buffers_off_keeps_buffers_local_like_torchs() -> None:
    run_distributed(buffers_stay_local, 2)


class RankLocalBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("mine", torch.full((3,), float(dist.get_rank())))


def buffers_at_construction(rank: int, world_size: int) -> dict[str, list[float]]:
    """torch 2.13: broadcast_buffers=False leaves the buffers out of the construction-time broadcast;
    forward_sync_buffers=False does not."""
    seen = {}
    for name, kwargs in (
        ("broadcast_buffers=False", {"broadcast_buffers": False}),
        ("forward_sync_buffers=False", {"forward_sync_buffers": False}),
        ("default", {}),
    ):
        for impl, cls in (("ours", OUR_DDP), ("torch", TORCH_DDP)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                seen[f"{impl} {name}"] = cls(RankLocalBuffer(), **kwargs).module.mine.tolist()
    return seen


@pytest.mark.slow
@pytest.mark.processes
def test_buffers_at_construction_follow_torchs_rule() -> None:
    ranks = run_distributed(buffers_at_construction, 2)
    for name in ("broadcast_buffers=False", "forward_sync_buffers=False", "default"):
        assert [r[f"ours {name}"] for r in ranks] == [r[f"torch {name}"] for r in ranks], name
    assert ranks[1]["ours broadcast_buffers=False"] == [1.0, 1.0, 1.0]  # kept its own
    assert ranks[1]["ours forward_sync_buffers=False"] == [0.0, 0.0, 0.0]  # took rank 0's


def forwards_alone_then_training(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank 0 alone runs forwards with gradients enabled (inference without torch.no_grad()) before any
    training: with torch's DDP nothing is communicated then, so nothing may wait for the other rank."""
    torch.manual_seed(0)
    model = OUR_DDP(mlp())
    if rank == 0:
        for step in range(3):
            model(rank_batch(rank, step, (4, 16)))
    dist.barrier()
    mlp_loss(model, 0).backward()  # then both train: the settings are compared, the gradients averaged
    return {name: p.grad for name, p in model.module.named_parameters()}


@pytest.mark.slow
@pytest.mark.processes
def test_a_rank_may_run_forwards_alone_before_training() -> None:
    ranks = run_distributed(forwards_alone_then_training, 2, timeout=60, pg_timeout=20)
    assert_same_tensors(ranks[0], ranks[1], "the averaged gradients", rtol=0, atol=0)


def wrapped_again(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same module wrapped again while the first wrapper lives on (not closed, not collected): the
    old wrapper's hooks let the new one's gradients pass, as torch's stale reducer does."""
    grads = {}
    for name, cls in (("ours", OUR_DDP), ("torch", TORCH_DDP)):
        torch.manual_seed(0)
        module = mlp()
        first = cls(module)
        mlp_loss(first, 0).backward()
        second = cls(module)
        for p in module.parameters():
            p.grad = None
        mlp_loss(second, 1).backward()
        grads[name] = {n: p.grad.clone() for n, p in module.named_parameters()}
    return grads


@pytest.mark.slow
@pytest.mark.processes
def test_a_module_wrapped_again_trains_like_torchs() -> None:
    for rank in run_distributed(wrapped_again, 2):
        assert_same_tensors(rank["ours"], rank["torch"], "gradients through the second wrapper", 1e-6, 1e-7)


IGNORED = ["3.weight", "1.running_mean"]  # a parameter and a buffer each rank keeps to itself


def with_ignored_tensors() -> nn.Module:
    """Ranks start with another ``3.weight`` and keep their own gradient of it and their own running mean."""
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[3].weight.add_(dist.get_rank())
    OUR_DDP._set_params_and_buffers_to_ignore_for_model(model, IGNORED)
    return model


def ignored_stay_local(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    summary = train_side_by_side(rank, with_ignored_tensors, mlp_loss, 3, {"bucket_cap_mb": 0.004}, {})
    return {"3.weight": summary["params"]["3.weight"], "0.weight": summary["params"]["0.weight"]}


@pytest.mark.slow
@pytest.mark.processes
def test_ignored_parameters_and_buffers_stay_local_like_torchs() -> None:
    """torch's ignore list (``_set_params_and_buffers_to_ignore_for_model``, Lightning's LightningModule
    attribute): not checked, broadcast nor reduced; every step equal to torch's on each rank."""
    ranks = run_distributed(ignored_stay_local, 2)
    assert not torch.equal(ranks[0]["3.weight"], ranks[1]["3.weight"])  # really local
    assert torch.equal(ranks[0]["0.weight"], ranks[1]["0.weight"])  # the rest synchronised


# --------------------------------------------------------------------------- static graph (2 ranks)
class Checkpointed(nn.Module):
    """Reentrant activation checkpointing: torch's DDP needs a static graph for it, set after wrapping."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.unused = nn.Linear(4, 4)  # unused in every iteration: found by the static graph's first one
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        hidden = torch.utils.checkpoint.checkpoint(self.block, hidden, use_reentrant=True)
        return self.head(hidden)


def set_static_graph_later(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    base = Checkpointed()
    models = [ddp_class(copy.deepcopy(base)) for ddp_class in (OUR_DDP, TORCH_DDP)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for model in models:
        model._set_static_graph()
    for step in range(4):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            mlp_loss(model, step).backward()
            optimizer.step()
        params = [dict(m.module.named_parameters()) for m in models]
        assert_same_tensors(params[0], params[1], f"rank {rank} step {step} param", 1e-6, 1e-7)


@pytest.mark.slow
@pytest.mark.processes
def test_set_static_graph_trains_like_torchs_with_checkpointing() -> None:
    run_distributed(set_static_graph_later, 2)


# ------------------------------------------------------------------------------ pickling (2 ranks)
def _save_and_load(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _train(model: nn.Module, steps: range) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in steps:
        optimizer.zero_grad()
        mlp_loss(model, step).backward()
        optimizer.step()


def copies_train_like_torchs(rank: int, world_size: int, how: str) -> dict[str, str]:
    duplicate = copy.deepcopy if how == "deepcopy" else _save_and_load
    torch.manual_seed(0)
    base = mlp()
    originals = [
        ddp_class(copy.deepcopy(base), bucket_cap_mb=0.004, gradient_as_bucket_view=True)
        for ddp_class in (OUR_DDP, TORCH_DDP)
    ]
    for model in originals:
        model.register_comm_hook(None, _good_hook)  # a summing hook: the copies must not keep it
        _train(model, range(2))  # a trained wrapper, buckets rebuilt, gradients in the buckets
    copies = [duplicate(model) for model in originals]
    assert isinstance(copies[0], OUR_DDP) and copies[0].comm_hook is None  # as torch: a hook stays behind
    assert copies[0].gradient_as_bucket_view and copies[0].bucket_cap_mb == 0.004
    for model in copies:
        _train(model, range(2, 5))
    params = [dict(m.module.named_parameters()) for m in copies]
    assert_same_tensors(params[0], params[1], f"rank {rank} copy param", 1e-6, 1e-7)
    # The original keeps training and is untouched by the copy's steps.
    for model in originals:
        _train(model, range(5, 7))
    params = [dict(m.module.named_parameters()) for m in originals]
    assert_same_tensors(params[0], params[1], f"rank {rank} original param", 1e-6, 1e-7)
    # A copy made on one rank only (e.g. for an EMA or to save) must not wait for the other ranks.
    if rank == 0:
        copy.deepcopy(originals[0]).module(torch.randn(2, 16))
    _train(originals[0], range(7, 8))
    # Only a module over the default group can be pickled, as in torch.
    subgroup = dist.new_group(list(range(world_size)))
    refusals = {}
    for ddp_class in (OUR_DDP, TORCH_DDP):
        on_subgroup = ddp_class(mlp(), process_group=subgroup)
        refusals[ddp_class.__module__] = "|".join(map(str, outcome(lambda m=on_subgroup: duplicate(m))[:2]))
    return refusals


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deepcopy", "torch_save_load"])
@pytest.mark.processes
def test_copies_train_like_torchs_copies(how: str) -> None:
    for refusals in run_distributed(copies_train_like_torchs, 2, how):
        ours, theirs = (
            refusals["lightning_ddpx.engine.module.data_parallel"],
            refusals["torch.nn.parallel.distributed"],
        )
        assert ours.startswith("RuntimeError|") and theirs.startswith("RuntimeError|")
        assert torch_sentence(theirs.split("|", 1)[1]) in ours


def test_unpickling_needs_the_default_group() -> None:
    with one_rank_group():
        buffer = io.BytesIO()
        torch.save(OUR_DDP(nn.Linear(3, 2)), buffer)
    buffer.seek(0)
    with pytest.raises(RuntimeError, match="needs the default process group"):
        torch.load(buffer, weights_only=False)


def test_a_copy_has_no_reducer_until_used() -> None:
    with one_rank_group():
        model = OUR_DDP(nn.Linear(3, 2))
        duplicate = copy.deepcopy(model)
        assert duplicate._reducer is None
        duplicate.close()  # nothing attached: nothing to do, and nothing built
        assert duplicate._reducer is None
        _train_one_step(duplicate)
        assert duplicate.synchronised_steps == 1 and model.synchronised_steps == 0


def test_rank_batch_is_rank_dependent() -> None:
    """The oracle's data differ per rank, so an unreduced gradient cannot match torch's by accident."""
    assert not torch.equal(rank_batch(0, 0, (2, 2)), rank_batch(1, 0, (2, 2)))


def test_the_strategies_pass_device_ids_as_lightnings_ddp() -> None:
    """Lightning's DDP strategies give torch's DDP ``device_ids=[root_device.index]`` on a GPU, None on the
    CPU; ours give our module the same (the Trainer's strategy through Lightning's own method)."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    from lightning_ddpx.lightning.settings.config import DDPXConfig, ddp_device_ids

    for device in (torch.device("cpu"), torch.device("cuda", 3)):
        fabric_ddp = FabricDDP(parallel_devices=[device])
        assert ddp_device_ids(device) == fabric_ddp._determine_ddp_device_ids()
    with one_rank_group():
        assert DDPXConfig().wrap(nn.Linear(3, 2), device_ids=None).device_ids is None


def ignored_pass_verification(rank: int, world_size: int) -> list[str]:
    model = OUR_DDP(with_ignored_tensors(), bucket_cap_mb=0.004)
    report = model.verify_replicas(buffers=True)  # 3.weight and 1.running_mean differ on purpose
    with torch.no_grad():
        model.module[0].weight[0, 0].add_(float(rank))  # a synchronised parameter diverges on rank 1
    try:
        model.verify_replicas()
    except lightning_ddpx.ReplicaMismatchError as error:
        return [str(report.tensors), str(error)]
    return [str(report.tensors), "no error"]


@pytest.mark.slow
@pytest.mark.processes
def test_verify_replicas_leaves_torchs_ignored_tensors_out() -> None:
    """Tensors on torch's ignore list differ across ranks by design: replica verification skips them and
    still catches a synchronised parameter that diverges."""
    for tensors, error in run_distributed(ignored_pass_verification, 2):
        assert tensors == "7", tensors  # 6 parameters + 3 buffers, less the two ignored
        assert "0.weight" in error and "ranks [1]" in error, error


# ------------------------------------------------------------------------- torch's usage logger
class _MixedNet(nn.Module):
    """Two dtypes (two buckets at least), a buffer: the keys about parameters and buckets have content."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2).double()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).double())


LOGGING_OPTIONS = {
    "defaults": {},
    "small_buckets_views_no_buffers": {"bucket_cap_mb": 0.0001, "gradient_as_bucket_view": True,
                                       "broadcast_buffers": False},
    "static_graph": {"static_graph": True},
    "torch_allreduce_hook": {"hook": True},
}  # fmt: skip
# Keys ours fills (docs/engine.md, "torch's usage logger"): each must be present, with torch's value and type.
FILLED_KEYS = {
    "backend_name", "world_size", "rank", "module_name", "device_ids", "output_device", "broadcast_buffers",
    "bucket_cap_bytes", "find_unused_parameters", "gradient_as_bucket_view", "is_multi_device_module",
    "num_parameter_tensors", "total_parameter_size_bytes", "dtypes", "bucket_sizes", "has_sync_bn",
    "iteration", "master_addr", "master_port", "torch_distributed_debug", "cuda_visible_devices",
    "gloo_socket_ifname", "gloo_device_transport",
}  # fmt: skip


def logging_data_of_both(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each class's ``_get_ddp_logging_data()`` after construction, after 1 step and after 14 steps (sample
    rate 4: torch's sampling leaves ``iteration`` at 12), on the same model and options."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    options = dict(options)
    hook = options.pop("hook", False)
    data: dict[str, dict[str, Any]] = {}
    for name, ddp_class in (("torch", TORCH_DDP), ("ours", OUR_DDP)):
        torch.manual_seed(0)
        model = ddp_class(_MixedNet(), **options)
        if hook:
            model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        model._set_ddp_runtime_logging_sample_rate(4)
        data[f"{name} constructed"] = model._get_ddp_logging_data()
        for step in range(14):
            model(rank_batch(rank, step, (5, 4))).sum().backward()
            if step == 0:
                data[f"{name} 1 step"] = model._get_ddp_logging_data()
        data[f"{name} 14 steps"] = model._get_ddp_logging_data()
    return data


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOGGING_OPTIONS))
@pytest.mark.processes
def test_usage_logging_data_matches_torchs(name: str) -> None:
    """Every key ours gives has torch's value and type on the same model and options; ours gives at least
    FILLED_KEYS, and the rebuild, hook and static-graph keys exactly when torch's does."""
    for rank_data in run_distributed(logging_data_of_both, 2, LOGGING_OPTIONS[name], timeout=180):
        for moment in ("constructed", "1 step", "14 steps"):
            theirs, ours = rank_data[f"torch {moment}"], rank_data[f"ours {moment}"]
            assert FILLED_KEYS <= ours.keys(), f"{moment}: missing {FILLED_KEYS - ours.keys()}"
            for key in ("has_rebuilt_buckets", "rebuilt_bucket_sizes", "static_graph", "comm_hook"):
                assert (key in ours) == (key in theirs), f"{moment}: {key} in ours {key in ours}"
            if "rebuilt_bucket_sizes" in ours:  # the same buckets; torch's order across dtypes is its map's
                ours, theirs = dict(ours), dict(theirs)
                ours["rebuilt_bucket_sizes"], theirs["rebuilt_bucket_sizes"] = (
                    sorted(data["rebuilt_bucket_sizes"].split(", ")) for data in (ours, theirs)
                )
            for key, value in ours.items():
                assert key in theirs and (value, type(value)) == (theirs[key], type(theirs[key])), (
                    f"{moment}: {key}: ours {value!r}, torch's {theirs.get(key)!r}"
                )
        assert rank_data["ours 14 steps"]["iteration"] == 12


@pytest.mark.processes
def test_a_hook_failure_is_logged_as_torchs_verify_ddp_error_logged_expects() -> None:
    """torch's own test helper finds the error a hook returning no future raised in ``error``."""
    from torch.testing._internal.common_distributed import verify_ddp_error_logged

    with one_rank_group():
        model = OUR_DDP(nn.Linear(3, 2))
        assert "error" not in model._get_ddp_logging_data()
        model.register_comm_hook(None, _returns_int)
        with pytest.raises(RuntimeError) as raised:
            model(torch.randn(4, 3)).sum().backward()
        verify_ddp_error_logged(model, str(raised.value))
        assert model._get_ddp_logging_data()["has_error"] == 1


@pytest.mark.parametrize("call", ["register_comm_hook", "sample_rate"])
@pytest.mark.processes
def test_refused_calls_are_logged_as_torchs(call: str) -> None:
    """A refused registration or sample rate: the same error type as torch's, and logged as torch logs it."""
    from torch.testing._internal.common_distributed import verify_ddp_error_logged

    def refuse(ddp_class: type) -> tuple[nn.Module, tuple[str, str, list[str]]]:
        model = ddp_class(nn.Linear(3, 2))
        if call == "sample_rate":
            return model, outcome(lambda: model._set_ddp_runtime_logging_sample_rate(0))
        return model, outcome(lambda: model.register_comm_hook(None, _hook_returning_int))

    with one_rank_group():
        theirs = refuse(TORCH_DDP)[1]
    with one_rank_group():
        model, ours = refuse(OUR_DDP)
        assert ours[0] == theirs[0] != "ok" and torch_sentence(theirs[1]) in ours[1], (ours, theirs)
        verify_ddp_error_logged(model, ours[1])
        assert model._get_ddp_logging_data()["error"] == f"<class '{ours[0]}'>: {ours[1]}"  # torch's form


def test_every_torch_argument_is_accepted_at_its_default_and_refused_by_name_otherwise() -> None:
    """A drop-in takes torch's whole signature: code passing torch's arguments explicitly at their defaults
    runs unchanged; the ones for features not implemented here raise by name for any other value."""

    from lightning_ddpx.engine.module.unsupported_options import UNSUPPORTED_TORCH_ARGUMENTS

    theirs = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    ours = inspect.signature(lightning_ddpx.DistributedDataParallel.__init__).parameters
    assert set(theirs) <= set(ours), f"torch's arguments missing here: {sorted(set(theirs) - set(ours))}"
    with one_rank_group():
        defaults = {name: theirs[name].default for name in UNSUPPORTED_TORCH_ARGUMENTS}
        assert set(defaults.values()) == {None}
        lightning_ddpx.DistributedDataParallel(nn.Linear(2, 2), **defaults).reducer.close()
        for name in UNSUPPORTED_TORCH_ARGUMENTS:
            with pytest.raises(ValueError, match=rf"torch's argument {name}=.* is not supported: "):
                lightning_ddpx.DistributedDataParallel(nn.Linear(2, 2), **{name: [1]})


TRUE_FALSE_ARGUMENTS = [
    name
    for name, parameter in __import__("inspect")
    .signature(lightning_ddpx.DistributedDataParallel)
    .parameters.items()
    if parameter.annotation in ("bool", "bool | None", bool)
]


def test_every_true_false_argument_is_checked_to_be_a_bool() -> None:
    """torch's DDP only tests truthiness, so ``static_graph="False"`` would mean True. Every argument
    annotated ``bool`` (found from the signature, so a new one is covered) refuses a string by name, and the
    two that default to ``None`` accept it."""
    assert len(TRUE_FALSE_ARGUMENTS) >= 9, TRUE_FALSE_ARGUMENTS  # the scan finds them
    for name in TRUE_FALSE_ARGUMENTS:
        with pytest.raises(TypeError, match=rf"{name} must be True(, False or None| or False), got 'False'"):
            lightning_ddpx.DistributedDataParallel(nn.Linear(2, 2), **{name: "False"})
    with one_rank_group():
        for name in ("broadcast_buffers", "forward_sync_buffers"):
            lightning_ddpx.DistributedDataParallel(nn.Linear(2, 2), **{name: None}).close()


def test_caps_written_as_int_or_float_are_one_setting() -> None:
    """Ranks compare their settings as text before the first reduction: ``bucket_cap_mb=25`` on one rank
    and ``25.0`` on another plan the same buckets, so they must read the same."""
    with one_rank_group():
        as_int = lightning_ddpx.DistributedDataParallel(
            nn.Linear(2, 2), bucket_cap_mb=25, first_bucket_cap_mb=1
        )
        as_float = lightning_ddpx.DistributedDataParallel(
            nn.Linear(2, 2), bucket_cap_mb=25.0, first_bucket_cap_mb=1.0
        )
        assert as_int.settings() == as_float.settings()
        as_int.close(), as_float.close()
