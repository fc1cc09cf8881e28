"""The configurations the benchmark compares, how each wraps a model, and what each costs in accuracy.

A contender is one way to run data parallelism: torch's DDP (the reference) or our module with one
communication hook. Accuracy cost is not measured by a timing benchmark, so each contender carries what is
known about it, and the recommendation only picks among those whose cost is known to be small.

:data:`CONTENDERS` is what ``python -m lightning_ddpx.bench`` offers; the developer benchmarks in
``benchmarks/`` build their own tables from the same :class:`Contender` and :func:`wrap` (torch's DDP with
torch's own hooks, one bucket for the whole model), so both measure a contender the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["CONTENDERS", "Contender", "START_POWERSGD_ITER", "contenders_named", "wrap"]

START_POWERSGD_ITER = 2  # compress from the third step, so a short warm-up already reaches compressed steps

_PAPER = "Vogels et al. 2019 matched full-precision accuracy with error feedback at rank 2-4"


@dataclass(frozen=True)
class Contender:
    """One timed configuration."""

    name: str
    hook: str | None  # a lightning_ddpx hook name (torch_ddp: "fp16" | "powersgd", torch's); None: no hook
    rank: int | None = None  # PowerSGD matrix_approximation_rank
    accuracy_cost: str = "none"  # "none" | "small" | "validate" | "not for training"
    accuracy_note: str = ""
    torch_ddp: bool = False  # torch's own DistributedDataParallel, the reference
    bucket_cap_mb: float | None = None  # a fixed bucket size, the first bucket's too; None: the run's

    @property
    def ours(self) -> bool:
        return not self.torch_ddp

    @property
    def usable(self) -> bool:
        """Whether the recommendation may pick it without the user validating accuracy first."""
        return self.accuracy_cost in ("none", "small")

    def strategy_arguments(self) -> str:
        """How to get this contender from ``DDPXStrategy`` (what the recommendation prints)."""
        if self.torch_ddp:
            return 'strategy="ddp"'
        if self.hook is None:
            return "DDPXStrategy()"
        if self.rank is not None:
            options = f'{_options_argument(self.hook)}={{"matrix_approximation_rank": {self.rank}}}'
            return f'DDPXStrategy(comm_hook="{self.hook}", {options})'
        return f'DDPXStrategy(comm_hook="{self.hook}")'


CONTENDERS: tuple[Contender, ...] = (
    Contender(
        "torch-ddp", None, accuracy_note="torch's DistributedDataParallel: the reference", torch_ddp=True
    ),
    # Our default reduction (scaled while copied into buckets), which comm_hook="allreduce" only slows down.
    Contender("allreduce", None, accuracy_note="exact average"),
    Contender("fp16", "fp16", accuracy_cost="small", accuracy_note="fp16 rounding; overflows above 65504"),
    Contender("bf16", "bf16", accuracy_cost="small", accuracy_note="bf16 rounding (8-bit mantissa)"),
    Contender("powersgd-r1", "powersgd", 1, "validate", "rank 1 may cost accuracy: validate on your task"),
    Contender("powersgd-r2", "powersgd", 2, "small", _PAPER),
    Contender("powersgd-r4", "powersgd", 4, "small", _PAPER),
    Contender(
        "batched-r1",
        "batched_powersgd",
        1,
        "validate",
        "the bucket as one square matrix: coarser than powersgd",
    ),
    Contender(
        "noop", "noop", accuracy_cost="not for training", accuracy_note="no communication: the ceiling"
    ),
)


def contenders_named(names: list[str] | None) -> tuple[Contender, ...]:
    """The contenders to run, in the canonical order; ``None`` means all. Unknown names are an error."""
    if names is None:
        return CONTENDERS
    known = {c.name: c for c in CONTENDERS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown contender(s) {unknown}; choose from {', '.join(known)}")
    return tuple(c for c in CONTENDERS if c.name in names)


def wrap(contender: Contender, module: nn.Module, bucket_cap_mb: float | None) -> tuple[nn.Module, Any]:
    """``(data-parallel module, hook state)`` for one contender; collective: every rank calls it in order.

    ``bucket_cap_mb`` applies unless the contender fixes its own; ``None``: the constructor's default layout.
    """
    buckets: dict[str, float] = {}
    if contender.bucket_cap_mb is not None:  # an explicit cap sizes the first bucket too (torch's rule, ours)
        buckets = {"bucket_cap_mb": contender.bucket_cap_mb}
    elif bucket_cap_mb is not None:
        buckets = {"bucket_cap_mb": bucket_cap_mb}
    if contender.torch_ddp:
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        ddp = TorchDDP(module, **buckets)
        return ddp, _register_torch_hook(contender, ddp)
    from lightning_ddpx import DistributedDataParallel
    from lightning_ddpx.hooks import build_comm_hook

    ddp = DistributedDataParallel(module, **buckets)
    if contender.hook is None:
        return ddp, None
    options = {}
    if contender.rank is not None:
        options[_options_argument(contender.hook)] = _powersgd_options(contender)
    state, hook = build_comm_hook(contender.hook, **options)
    ddp.register_comm_hook(state, hook)
    return ddp, state


def _options_argument(hook: str) -> str:
    """The argument that carries ``hook``'s options, as the hook registry declares it (``powersgd`` for both
    PowerSGD names): ``rank`` is an option of a PowerSGD contender."""
    from lightning_ddpx.hooks.registry import hook_entry

    entry = hook_entry(hook)
    if entry is None or entry.options_type is None:
        raise ValueError(f"contender hook {hook!r} takes no options, so it cannot take a rank")
    return entry.keyword


def _powersgd_options(contender: Contender) -> dict[str, int]:
    return {"matrix_approximation_rank": contender.rank, "start_powerSGD_iter": START_POWERSGD_ITER}


def _register_torch_hook(contender: Contender, ddp: nn.Module) -> Any:
    """Register torch's own ``fp16_compress_hook`` or ``powerSGD_hook`` on torch's DDP; the hook state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if contender.hook is None:
        return None
    if contender.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if contender.hook == "powersgd" and contender.rank is not None:
        state = powerSGD_hook.PowerSGDState(process_group=None, **_powersgd_options(contender))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    raise ValueError(
        f"contender {contender.name!r}: torch's DDP takes hook='fp16' or hook='powersgd' with a rank, got "
        f"hook={contender.hook!r}, rank={contender.rank!r}; use one of those or torch_ddp=False for ours"
    )


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of all trainable gradients: what a plain allreduce sends per step."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def is_ours(module: nn.Module) -> bool:
    return hasattr(module, "comm_stats")
