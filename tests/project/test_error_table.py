"""Bad input fails before work is lost, with a message naming the culprit and the fix: one table of cases.

Each :class:`Case` says how to trigger the problem, which exception (or warning) must result, and which
substrings its message must hold: the culprit (option, parameter, rank, hook, bucket, checkpoint key)
and the fix. Local cases run in this process, some inside a one-rank gloo group (cheap: no peers);
the cases that need two ranks that disagree run together in ONE 2-rank gloo job, each in a fresh module,
and the test for each case reads its outcome from that job. ``docs/troubleshooting.md`` documents every
error; the last test here fails when the package raises an error the page does not mention.
"""

from __future__ import annotations

import ast
import contextlib
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from lightning_ddpx import DDPXStrategy, checkpoint_state
from lightning_ddpx.hooks import (
    PowerSGDOptions,
    PowerSGDState,
    allreduce_hook,
    backend_support,
    bf16_compress_hook,
    bf16_compress_wrapper,
    build_comm_hook,
    powersgd_hook,
)
from lightning_ddpx.lightning.settings.config import DDPXConfig
from tests.dist_utils import one_rank_group, run_distributed

REPO_ROOT = Path(__file__).resolve().parents[2]
DDP = lightning_ddpx.DistributedDataParallel


@dataclass(frozen=True)
class Case:
    id: str
    trigger: Callable[..., Any]  # local: trigger(); two ranks: trigger(rank)
    expected: type[BaseException] | type[Warning]
    must_say: tuple[str, ...]  # culprit and fix; "{rank}" stands for the rank running the case
    where: str = "local"  # "local": no process group; "one_rank": a 1-rank gloo group; "two_ranks"


# ------------------------------------------------------------------------------------- models, helpers
def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def loss_of(model: nn.Module, rank: int = 0) -> torch.Tensor:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    return model(x).square().mean()


class Skips(nn.Module):
    """Forward never uses ``skipped``: without find_unused_parameters its gradient never arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.skipped = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def completed(value: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def outcome(trigger: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """The exception ``trigger`` raised and the warnings it emitted, as (type, message) pairs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = None
        try:
            trigger(*args)
        except Exception as raised:  # noqa: BLE001 - the table says which type is expected
            error = (type(raised), str(raised))
    return {"error": error, "warnings": [(w.category, str(w.message)) for w in caught]}


def check(case: Case, seen: dict[str, Any], rank: int = 0) -> None:
    must_say = [s.replace("{rank}", str(rank)) for s in case.must_say]
    if issubclass(case.expected, Warning):
        assert seen["error"] is None, f"{case.id}: expected a warning, got {seen['error']}"
        candidates = [m for cls, m in seen["warnings"] if issubclass(cls, case.expected)]
        assert any(all(s in m for s in must_say) for m in candidates), (case.id, must_say, seen["warnings"])
        return
    assert seen["error"] is not None, f"{case.id}: no error (warnings: {seen['warnings']})"
    kind, message = seen["error"]
    assert issubclass(kind, case.expected), f"{case.id}: {kind.__name__}: {message}"
    missing = [s for s in must_say if s not in message]
    assert not missing, f"{case.id}: {missing} not in: {message}"


# ------------------------------------------------------------------------------------ local triggers
def no_sync_inside_backward() -> None:
    model = DDP(net())

    def enter_no_sync(_param: torch.Tensor) -> None:
        with model.no_sync():
            pass

    model.module[0].weight.register_post_accumulate_grad_hook(enter_no_sync)  # runs after the reducer's
    loss_of(model).backward()


def forward_after_unfinished_backward() -> None:
    model = DDP(net())

    def interrupt(_param: torch.Tensor) -> None:
        raise ValueError("backward interrupted")

    handle = model.module[0].weight.register_post_accumulate_grad_hook(interrupt)
    with pytest.raises(ValueError, match="backward interrupted"):
        loss_of(model).backward()
    handle.remove()
    loss_of(model)


def hook_after_training_started() -> None:
    model = DDP(net())
    loss_of(model).backward()
    model.register_comm_hook(None, allreduce_hook)


def hook_twice() -> None:
    model = DDP(net())
    model.register_comm_hook(None, allreduce_hook)
    model.register_comm_hook(None, allreduce_hook)


def hook_returning_int(state: object, bucket: object) -> int:
    return 0


def static_graph_after_training() -> None:
    model = DDP(net())
    loss_of(model).backward()
    model._set_static_graph()


def pickle_on_a_subgroup() -> None:
    import copy

    copy.deepcopy(DDP(net(), process_group=dist.new_group([0])))


def unpickle_without_a_group() -> None:
    import io

    buffer = io.BytesIO()
    torch.save(DDP(net()), buffer)
    dist.destroy_process_group()  # the case runs inside a one-rank group: leave none for the load
    try:
        buffer.seek(0)
        torch.load(buffer, weights_only=False)
    finally:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


@contextlib.contextmanager
def simulated_nccl(version: tuple[int, ...]) -> Iterator[None]:
    """Make the default group look like NCCL ``version`` on a GPU with bfloat16 (nothing else changes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend_support, "_backend_for", lambda group, device: "nccl")
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda.nccl, "version", lambda: version)
        patch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
        yield


def bf16_hook_on_old_nccl() -> None:
    with simulated_nccl((2, 9, 9)):
        build_comm_hook("bf16")


def bf16_wrapper_on_backend_failing_the_probe() -> None:
    model = DDP(net())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend_support, "_backend_for", lambda group, device: "mybackend")
        patch.setattr(backend_support, "_probed", {})

        def all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
            raise RuntimeError(f"mybackend: unsupported dtype {tensor.dtype}")

        patch.setattr(backend_support.dist, "all_reduce", all_reduce)
        model.register_comm_hook(
            PowerSGDState(None, start_powerSGD_iter=2), bf16_compress_wrapper(powersgd_hook)
        )


class UnpicklableState:
    """A custom hook state whose state_dict holds an object weights_only loading cannot read back."""

    def state_dict(self) -> dict:
        return {"shared": {"rng": np.random.RandomState(0)}, "per_rank": {}}

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - never loaded
        pass


class FlatState(UnpicklableState):
    def state_dict(self) -> dict:
        return {"iteration": 3}


def powersgd_config(rank: int = 1) -> DDPXConfig:
    return DDPXConfig(
        comm_hook="powersgd", powersgd={"start_powerSGD_iter": 2, "matrix_approximation_rank": rank}
    )


def saved_entry(world_size: int = 1, hook: str | None = None) -> dict[str, Any]:
    """The checkpoint entry the strategies save after 4 PowerSGD steps (with warm-start and error memory)."""
    config = powersgd_config()
    module = config.wrap(net())
    state = config.register_hook(module)
    for step in range(4):
        loss_of(module, step).backward()
    assert state.shared.q and state.per_rank.error  # memory exists, so corrupting it means something
    entry = config.hook_entry(state, module.process_group, module.reducer_state_dict())
    module.close()
    assert entry is not None
    entry["world_size"], entry["per_rank"] = world_size, entry["per_rank"] * world_size
    if hook is not None:
        entry["hook"] = hook
    return entry


def resume(entry: dict[str, Any] | None, rank: int = 1) -> None:
    """What a strategy does with a loaded checkpoint's entry once its module and hook exist (setup)."""
    config = powersgd_config(rank)
    module = config.wrap(net())
    config.restore_hook_entry(module, config.register_hook(module), entry)


def corrupted(edit: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    def trigger() -> None:
        entry = saved_entry()
        edit(entry)
        resume(entry)

    return trigger


def other_model_layout(entry: dict[str, Any]) -> None:
    entry["bucket_layout"]["parameter_order"] = ["encoder.weight", "encoder.bias"]


def drop_rng_state(entry: dict[str, Any]) -> None:
    del entry["shared"]["rng_state"]


def q_as_list(entry: dict[str, Any]) -> None:
    entry["shared"]["q"][0] = entry["shared"]["q"][0].tolist()


def truncate_error(entry: dict[str, Any]) -> None:
    entry["per_rank"][0]["error"][0] = entry["per_rank"][0]["error"][0][:-1]


# --------------------------------------------------------------------------------- two-rank triggers
def model_shape_differs(rank: int) -> None:
    DDP(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 5 if rank == 1 else 4)))


def model_dtype_differs(rank: int) -> None:
    DDP(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 4)).to(torch.float64 if rank == 1 else torch.float32))


def model_count_differs(rank: int) -> None:
    DDP(nn.Sequential(*[nn.Linear(3, 3) for _ in range(3 if rank == 1 else 2)]))


def model_requires_grad_differs(rank: int) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[0].bias.requires_grad_(rank == 0)
    DDP(model)


def buffer_rules_differ(rank: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated by torch
        DDP(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), broadcast_buffers=rank == 1)


def parameter_without_gradient(rank: int) -> None:
    loss_of(DDP(Skips()), rank).backward()


def wrong_size_result(state: Any, bucket: Any) -> torch.futures.Future:
    return completed(bucket.buffer()[:-1])


def integer_result(state: Any, bucket: Any) -> torch.futures.Future:
    return completed(bucket.buffer().to(torch.int32))


def failing_hook(state: Any, bucket: Any) -> torch.futures.Future:
    raise ValueError("deliberate failure in a user hook")


def averaging_skipped(rank: int) -> None:
    """DiLoCo on the bare module, with no ``average_parameters_after_step()`` after the optimizer step."""
    model = DDP(net())
    model.register_comm_hook(*build_comm_hook("diloco", diloco={"period": 2}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss_of(model, rank).backward()
        optimizer.step()


def backward_with_hook(hook: Callable[..., Any]) -> Callable[[int], None]:
    def trigger(rank: int) -> None:
        model = DDP(net())
        model.register_comm_hook(None, hook)
        loss_of(model, rank).backward()

    return trigger


# -------------------------------------------------------------------------------------------- table
CASES: list[Case] = [
    # --- names and options: fail in the constructor, before any process starts
    Case("unknown_hook_name", lambda: build_comm_hook("powerSGD"), ValueError,
         ("'powerSGD'", "valid names are", "'powersgd'")),
    Case("unknown_wrapper", lambda: build_comm_hook("allreduce", wrapper="fp8"), ValueError,
         ("'fp8'", "valid wrappers are ['bf16', 'fp16']")),
    Case("strategy_unknown_comm_hook", lambda: DDPXStrategy(comm_hook="powersdg"), ValueError,
         ("'powersdg'", "Registered names", "import path")),
    Case("strategy_unknown_wrapper", lambda: DDPXStrategy(comm_hook="powersgd", comm_wrapper="fp8"), ValueError,
         ("comm_wrapper", "'fp8'", "['bf16', 'fp16']")),
    Case("powersgd_rank_below_1", lambda: PowerSGDOptions(matrix_approximation_rank=0), ValueError,
         ("matrix_approximation_rank must be >= 1", "got 0", "Use 1")),
    Case("start_iter_below_2_with_error_feedback",
         lambda: PowerSGDOptions(start_powerSGD_iter=1, warm_start=False), ValueError,
         ("start_powerSGD_iter=1", "use_error_feedback=True", "Set start_powerSGD_iter >= 2")),
    Case("start_iter_below_2_with_warm_start",
         lambda: PowerSGDOptions(start_powerSGD_iter=0, use_error_feedback=False), ValueError,
         ("start_powerSGD_iter=0", "warm_start=True", "start_powerSGD_iter >= 2", "warm_start=False")),
    Case("strategy_start_iter_below_2",
         lambda: DDPXStrategy(comm_hook="powersgd", powersgd={"start_powerSGD_iter": 1}), ValueError,
         ("DDPXStrategy: powersgd=", "start_powerSGD_iter >= 2")),
    Case("powersgd_unknown_option", lambda: build_comm_hook("powersgd", powersgd={"rank": 2}), ValueError,
         ("['rank']", "valid options are", "matrix_approximation_rank")),
    Case("powersgd_options_for_optionless_hook",
         lambda: build_comm_hook("fp16", powersgd={"matrix_approximation_rank": 2}), ValueError,
         ("'fp16'", "takes no powersgd options", "'powersgd'")),
    Case("bucket_cap_not_positive", lambda: DDP(nn.Linear(2, 2), bucket_cap_mb=0), ValueError,
         ("bucket_cap_mb", "got 0", "positive number of MiB", "25")),
    Case("first_bucket_cap_not_positive", lambda: DDP(nn.Linear(2, 2), first_bucket_cap_mb=-1.0), ValueError,
         ("first_bucket_cap_mb", "-1.0", "positive number of MiB")),
    Case("strategy_bucket_cap_not_positive", lambda: DDPXStrategy(bucket_cap_mb=0), ValueError,
         ("DDPXStrategy: bucket_cap_mb", "positive number")),
    Case("bucket_cap_infinite", lambda: DDP(nn.Linear(2, 2), bucket_cap_mb=float("inf")), ValueError,
         ("bucket_cap_mb", "got inf", "positive number of MiB")),
    Case("bucket_cap_below_one_byte", lambda: DDP(nn.Linear(2, 2), first_bucket_cap_mb=1e-7), ValueError,
         ("first_bucket_cap_mb", "got 1e-07", "at least one byte")),
    Case("bucket_cap_too_large_for_a_float", lambda: DDP(nn.Linear(2, 2), bucket_cap_mb=10**400), ValueError,
         ("bucket_cap_mb", "finite")),
    Case("bucket_cap_too_large_in_bytes", lambda: DDP(nn.Linear(2, 2), bucket_cap_mb=1e303), ValueError,
         ("bucket_cap_mb", "got 1e+303", "finite")),
    Case("strategy_bucket_cap_too_large_in_bytes", lambda: DDPXStrategy(bucket_cap_mb=1e303), ValueError,
         ("DDPXStrategy: bucket_cap_mb", "finite")),
    Case("strategy_bucket_cap_below_one_byte", lambda: DDPXStrategy(bucket_cap_mb=1e-7), ValueError,
         ("DDPXStrategy: bucket_cap_mb", "at least one byte")),
    Case("flag_given_a_string", lambda: DDP(nn.Linear(2, 2), static_graph="False"), TypeError,
         ("static_graph must be True or False", "'False' (str)")),
    Case("optional_flag_given_a_number", lambda: DDP(nn.Linear(2, 2), forward_sync_buffers=0), TypeError,
         ("forward_sync_buffers must be True, False or None", "got 0 (int)")),
    Case("strategy_flag_given_a_string", lambda: DDPXStrategy(find_unused_parameters="True"), TypeError,
         ("DDPXStrategy: find_unused_parameters must be True or False", "'True' (str)")),
    Case("process_group_not_a_group", lambda: DDP(nn.Linear(2, 2), process_group=0), TypeError,
         ("process_group must be a torch.distributed.ProcessGroup", "dist.new_group", "got int")),
    Case("strategy_bucket_cap_infinite", lambda: DDPXStrategy(first_bucket_cap_mb=float("inf")), ValueError,
         ("DDPXStrategy: first_bucket_cap_mb", "positive number")),
    Case("no_process_group", lambda: DDP(nn.Linear(2, 2)), RuntimeError,
         ("init_process_group", "DDPXStrategy")),
    Case("wrapper_of_non_callable", lambda: bf16_compress_wrapper(3), TypeError,
         ("bf16_compress_wrapper", "int", "communication hook")),
    # --- construction and hook setup on a (one-rank) process group
    Case("parameters_on_mixed_devices",
         lambda: DDP(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))), ValueError,
         ("'1.weight'", "meta", "module.to(device)"), "one_rank"),
    Case("no_trainable_parameters", lambda: DDP(nn.Linear(2, 2).requires_grad_(False)), ValueError,
         ("requires_grad=True", "Unfreeze"), "one_rank"),
    Case("hook_wrong_signature", lambda: DDP(net()).register_comm_hook(None, lambda bucket: bucket), TypeError,
         ("<lambda>", "hook(state, bucket)", "torch.futures.Future"), "one_rank"),
    Case("hook_registered_twice", hook_twice, RuntimeError,
         ("allreduce_hook", "already registered", "can only be called once", "new DistributedDataParallel"),
         "one_rank"),
    Case("no_parameters_runtime_error", lambda: DDP(nn.Module()), RuntimeError,
         ("no parameters", "doesn't have any parameter that requires a gradient"), "one_rank"),
    Case("device_ids_for_cpu_module", lambda: DDP(net(), device_ids=[0]), ValueError,
         ("device_ids=[0]", "on cpu", "Leave both unset", "only work with"), "one_rank"),
    Case("device_ids_not_a_list", lambda: DDP(net(), device_ids=0), TypeError,
         ("device_ids must be a list of one device", "device_ids=[local_rank]", "got 0 (int)"), "one_rank"),
    Case("device_ids_several", lambda: DDP(net(), device_ids=[0, 1]), ValueError,
         ("device_ids=[0, 1]", "one process per GPU", "device_ids=[local_rank]"), "one_rank"),
    Case("check_reduction_deprecated", lambda: DDP(net(), check_reduction=True), FutureWarning,
         ("check_reduction is ignored", "remove it"), "one_rank"),
    Case("hook_not_callable", lambda: DDP(net()).register_comm_hook(None, 1), TypeError,
         ("must be callable", "int"), "one_rank"),
    Case("hook_return_annotation", lambda: DDP(net()).register_comm_hook(None, hook_returning_int), ValueError,
         ("hook_returning_int", "annotated to return int", "get_future()"), "one_rank"),
    Case("static_graph_after_training", static_graph_after_training, RuntimeError,
         ("_set_static_graph()", "1 synchronised iteration", "static_graph=True"), "one_rank"),
    Case("pickle_on_a_subgroup", pickle_on_a_subgroup, RuntimeError,
         ("other than the default one", "model.module"), "one_rank"),
    Case("unpickle_without_a_group", unpickle_without_a_group, RuntimeError,
         ("needs the default process group", "init_process_group", "model.module"), "one_rank"),
    Case("hook_after_training_started", hook_after_training_started, RuntimeError,
         ("before the first backward", "1 synchronised iteration"), "one_rank"),
    Case("bf16_hook_on_nccl_before_2_10", bf16_hook_on_old_nccl, TypeError,
         ("'bf16_compress_hook'", "NCCL backend (version 2.9.9)", "2.10", "comm_hook='fp16'"), "one_rank"),
    Case("bf16_wrapper_on_backend_without_bf16", bf16_wrapper_on_backend_failing_the_probe, TypeError,
         ("'bf16_cast_powersgd_hook'", "'mybackend'", "unsupported dtype", "comm_wrapper='fp16'"), "one_rank"),
    Case("hook_state_not_weights_only_loadable",
         lambda: checkpoint_state.gather_entry(UnpicklableState(), "custom"), TypeError,
         ("state_dict()['shared']['rng']", "RandomState", "weights_only=True", "Convert it"), "one_rank"),
    Case("hook_state_dict_without_shared_and_per_rank",
         lambda: checkpoint_state.gather_entry(FlatState(), "custom"), TypeError,
         ("'custom'", "['iteration']", "{'shared': {...}, 'per_rank': {...}}"), "one_rank"),
    # --- no_sync misuse and interrupted iterations (would leave ranks out of step)
    Case("no_sync_entered_during_backward", no_sync_inside_backward, RuntimeError,
         ("rank 0", "no_sync()", "already started reducing", "other ranks would wait", "before the forward"),
         "one_rank"),
    Case("forward_after_unfinished_backward", forward_after_unfinished_backward, RuntimeError,
         ("never finished", "buckets not launched", "restart from a checkpoint"), "one_rank"),
    # --- checkpoints and resume (what DDPXStrategy does with the loaded entry)
    Case("checkpoint_hook_state_missing_key", corrupted(drop_rng_state), ValueError,
         ("checkpoint['lightning_ddpx']", "['shared'] lacks the key(s) ['rng_state']",
          "delete checkpoint['lightning_ddpx']"), "one_rank"),
    Case("checkpoint_hook_state_wrong_type", corrupted(q_as_list), ValueError,
         ("checkpoint['lightning_ddpx']", "['shared']['q'][0] is a list", "floating-point tensor",
          "resume from another checkpoint"), "one_rank"),
    Case("checkpoint_hook_state_wrong_size", corrupted(truncate_error), ValueError,
         ("checkpoint['lightning_ddpx']", "['per_rank']['error'][0] has", "bucket 0's saved layout needs",
          "delete checkpoint['lightning_ddpx']"), "one_rank"),
    Case("checkpoint_from_another_hook",
         lambda: resume(saved_entry(hook="allreduce")), UserWarning,
         ("written with comm hook 'allreduce'", "uses 'powersgd'", "starts fresh"), "one_rank"),
    Case("checkpoint_bucket_layout_of_another_model", corrupted(other_model_layout), UserWarning,
         ("bucket layout does not fit this model", "'encoder.weight'", "planned afresh"), "one_rank"),
    Case("checkpoint_without_hook_state", lambda: resume(None), UserWarning,
         ("holds no communication-hook state", "'powersgd'", "starts fresh"), "one_rank"),
    Case("resume_on_other_world_size", lambda: resume(saved_entry(world_size=2)),
         UserWarning, ("written by 2 processes", "this run has 1", "error feedback", "starts from zero"),
         "one_rank"),
    Case("resume_with_other_powersgd_rank", lambda: resume(saved_entry(), rank=2),
         UserWarning, ("matrix_approximation_rank=1", "this state uses 2", "reset"), "one_rank"),
    # --- ranks that disagree: every rank raises, naming the parameter and each rank's value
    Case("model_shape_differs", model_shape_differs, RuntimeError,
         ("'1.weight'", "shape", "rank 0: (4, 3)", "rank 1: (5, 3)", "Build the same model on every rank"),
         "two_ranks"),
    Case("model_dtype_differs", model_dtype_differs, ValueError,
         ("'0.weight'", "dtype", "rank 0: 'torch.float32'", "rank 1: 'torch.float64'", "Build the same model"),
         "two_ranks"),
    Case("model_parameter_count_differs", model_count_differs, RuntimeError,  # torch's type (and ValueError)
         ("'2.weight'", "rank 0: missing", "Parameter counts per rank: [4, 6]", "Build the same model",
          "DDP expects same model across all ranks, but Rank 0 has 4 params, while rank 1 has inconsistent 6 "
          "params."), "two_ranks"),
    Case("model_requires_grad_differs", model_requires_grad_differs, ValueError,
         ("'0.bias'", "requires_grad", "rank 0: True", "rank 1: False", "same requires_grad flags"),
         "two_ranks"),
    Case("buffer_rules_differ", buffer_rules_differ, ValueError,
         ("different buffer rules", "[False, True]", "same broadcast_buffers / forward_sync_buffers"), "two_ranks"),
    Case("parameter_without_gradient", parameter_without_gradient, RuntimeError,
         ("rank {rank}", "'skipped.weight'", "'skipped.bias'", "find_unused_parameters=True",
          "ddpx_find_unused_parameters_true",
          # torch's sentences, which tests written for torch's DDP match
          "making sure all `forward` function outputs participate in calculating loss",
          "Parameter indices which did not receive grad for rank {rank}: 2 3",
          "Parameters which did not receive grad for rank {rank}: skipped.weight, skipped.bias"), "two_ranks"),
    Case("hook_result_wrong_size", backward_with_hook(wrong_size_result), RuntimeError,
         ("wrong_size_result", "bucket 0", "same size as bucket.buffer()"), "two_ranks"),
    Case("hook_result_wrong_dtype", backward_with_hook(integer_result), RuntimeError,
         ("integer_result", "torch.int32", "floating dtype"), "two_ranks"),
    Case("hook_raises", backward_with_hook(failing_hook), RuntimeError,
         ("failing_hook", "bucket 0", "deliberate failure"), "two_ranks"),
    Case("parameter_averaging_skipped", averaging_skipped, RuntimeError,
         ("rank {rank}", "DiLoCo's outer step", "model.average_parameters_after_step() after every optimizer.step()",
          "docs/diloco.md"), "two_ranks"),
]  # fmt: skip
BY_ID = {case.id: case for case in CASES}
LOCAL = [case for case in CASES if case.where != "two_ranks"]
TWO_RANKS = [case for case in CASES if case.where == "two_ranks"]


def test_table_is_large_and_ids_are_unique() -> None:
    assert len(BY_ID) == len(CASES) >= 30
    assert {case.where for case in CASES} == {"local", "one_rank", "two_ranks"}


@pytest.mark.parametrize("case", LOCAL, ids=[case.id for case in LOCAL])
def test_local_case(case: Case) -> None:
    with one_rank_group() if case.where == "one_rank" else contextlib.nullcontext():
        seen = outcome(case.trigger)
    check(case, seen)


def run_two_rank_cases(rank: int, world_size: int, ids: list[str]) -> dict[str, Any]:
    """Every two-rank case in turn on this rank, each in a fresh module (one process group for all)."""
    return {case_id: outcome(BY_ID[case_id].trigger, rank) for case_id in ids}


@pytest.fixture(scope="module")
def two_rank_outcomes() -> list[dict[str, Any]]:
    return run_distributed(run_two_rank_cases, 2, [case.id for case in TWO_RANKS], timeout=120)


@pytest.mark.parametrize("case", TWO_RANKS, ids=[case.id for case in TWO_RANKS])
@pytest.mark.processes
def test_two_rank_case(case: Case, two_rank_outcomes: list[dict[str, Any]]) -> None:
    for rank, seen in enumerate(two_rank_outcomes):
        check(case, seen[case.id], rank)


# ------------------------------------------------------------------------- bf16 support: the real paths
def test_bf16_on_gloo_builds_registers_and_reduces() -> None:
    with one_rank_group():
        assert backend_support.bf16_reduction_problem(None, torch.device("cpu"), probe=True) is None
        state, hook = build_comm_hook("bf16")
        assert hook is bf16_compress_hook
        model = DDP(net())
        model.register_comm_hook(state, hook)
        loss = loss_of(model)
        loss.backward()
        reference = net()
        loss_of(reference).backward()
        for ours, theirs in zip(model.module.parameters(), reference.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad.bfloat16().float())


def test_bf16_unknown_backend_is_probed_once_and_passes_on_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(backend_support, "_backend_for", lambda group, device: "custom")
    monkeypatch.setattr(backend_support, "_probed", {})
    monkeypatch.setattr(
        backend_support.dist,
        "all_reduce",
        lambda t, group=None: calls.append(t.dtype) or real_all_reduce(t, group=group),
    )
    with one_rank_group():
        build_comm_hook("bf16")  # build time: no probe (not every rank need build hooks together)
        assert calls == []
        for _ in range(2):
            DDP(net()).register_comm_hook(None, bf16_compress_wrapper(allreduce_hook))
    assert calls == [torch.bfloat16]  # registration probed, once per backend


@pytest.mark.parametrize(
    "version, bf16_device, problem",
    [((2, 9, 9), True, "version 2.9.9"), ((2, 21, 5), False, "no native bfloat16"), ((2, 21, 5), True, None)],
)
def test_nccl_rule(monkeypatch: pytest.MonkeyPatch, version, bf16_device, problem) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_device)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    found = backend_support._nccl_problem()
    assert found is None if problem is None else problem in found


def test_other_hooks_are_not_bf16() -> None:
    assert backend_support.reduces_in_bfloat16(bf16_compress_wrapper(powersgd_hook))
    assert backend_support.reduces_in_bfloat16(bf16_compress_hook)
    assert not backend_support.reduces_in_bfloat16(allreduce_hook)
    assert not backend_support.reduces_in_bfloat16(build_comm_hook("allreduce", wrapper="fp16")[1])


def test_corrupt_state_leaves_the_state_unchanged() -> None:
    with one_rank_group():
        entry = saved_entry()
    state = PowerSGDState.from_options(powersgd_config().powersgd)
    state.load_state_dict({"shared": entry["shared"], "per_rank": entry["per_rank"][0]})  # valid: accepted
    before = state.state_dict()
    for edit in (lambda sd: sd["shared"]["layout"].update({0: [0, 2, 8]}), lambda sd: sd["shared"].pop("q")):
        bad = state.state_dict()
        edit(bad)  # a shape cut short; warm-start memory missing
        with pytest.raises(ValueError, match=r"PowerSGD state_dict\['shared'\]"):
            state.load_state_dict(bad)
    after = state.state_dict()
    assert after["shared"].pop("names") == before["shared"].pop("names")  # strings: assert_close skips them
    torch.testing.assert_close(after, before)


# ------------------------------------------------------------------------ the troubleshooting page
PAGE = REPO_ROOT / "docs" / "troubleshooting.md"


def normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "").replace("\\", "")).strip()


# Benchmark tooling, never raised while training: its errors are documented where it is used.
NOT_ON_THE_PAGE = (
    "lightning_ddpx/bench/",
    "lightning_ddpx/__init__.py",  # only Python's own "has no attribute" from the lazy-import __getattr__
)
_PREFIX = re.compile(r"^(lightning_ddpx(\.\w+)*|DDPXStrategy)(\s\(rank)?\W*")


def message_key(node: ast.expr) -> str | None:
    """The first literal run of at least three words in a message expression, cut to five words."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts = [node.value]
    elif isinstance(node, ast.JoinedStr):
        parts = [v.value if isinstance(v, ast.Constant) else "\0" for v in node.values]
    else:
        return None
    for chunk in "".join(parts).split("\0"):
        words = re.sub(r"^\W+", "", _PREFIX.sub("", chunk.strip())).split()
        if len(words) >= 3:
            return " ".join(words[:5])
    return None


def _message_of(node: ast.AST) -> ast.expr | None:
    """The message argument of a raise (public exception types only: a leading underscore marks an
    internal exception that is wrapped before users see it) or of a warning, else None."""
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
        name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
        return None if name.startswith("_") else node.exc.args[0]
    if isinstance(node, ast.Call):
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name in ("warn", "rank_zero_warn") and node.args:
            return node.args[0]
        if name == "Restore" and len(node.args) == 2:  # checkpoint_state: the warning a resume shows
            return node.args[1]
    return None


def raised_messages() -> list[tuple[str, str]]:
    """(where, key) for every error and warning the package raises with a literal message."""
    found = []
    for path in sorted((REPO_ROOT / "lightning_ddpx").rglob("*.py")):
        where = path.relative_to(REPO_ROOT).as_posix()
        if where.startswith(NOT_ON_THE_PAGE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            message = _message_of(node)
            key = message_key(message) if message is not None else None
            if key is not None:
                found.append((f"{where}:{node.lineno}", key))
    return found


def test_troubleshooting_page_mentions_every_error() -> None:
    page = normalised(PAGE.read_text())
    messages = raised_messages()
    assert len(messages) >= 40  # the scan finds the package's errors (guards against a broken scan)
    undocumented = [f"{where}: {key!r}" for where, key in messages if normalised(key) not in page]
    assert not undocumented, "add these errors to docs/troubleshooting.md:\n" + "\n".join(undocumented)
