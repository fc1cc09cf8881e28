"""Periodic model averaging after the optimizer step: the second half of post-local SGD.

After ``start_localSGD_iter`` steps the post-local SGD hook (:mod:`lightning_ddpx.hooks.post_local_sgd`)
stops averaging gradients across the whole group; the replicas then drift apart and an averager pulls them
back together every ``period`` optimizer steps by averaging the parameters themselves. Semantics are
torch's (``torch.distributed.algorithms.model_averaging``):

- :class:`PeriodicModelAverager`: at step ``s`` (counted by calls to :meth:`average_parameters`, i.e. one
  per optimizer step), average when ``s >= warmup_steps`` and ``(s - warmup_steps) % period == 0``;
- :class:`HierarchicalModelAverager`: ``{period: group_size}``; at step ``s >= warmup_steps`` average in
  groups of the size belonging to the largest period dividing ``s`` (note: ``s``, not ``s - warmup``).

Torch's call, ``average_parameters(params)``, averages the given parameters that have a gradient (a frozen
or unused parameter stays local). Each averager is also a
:class:`~lightning_ddpx.engine.optim.parameter_averaging.ParameterAveraging`: registered with the module
(``PostLocalSGDState`` brings its averager), it runs at ``model.average_parameters_after_step()``, which
the strategies call after every optimizer step, over every parameter the optimizers update. Unlike torch,
parameters are updated in place (``copy_``), so optimizer state, gradient bucket views and anything else
holding the parameter's storage keep seeing it. The step counter is the averager's only state:
``state_dict() == {"step": n}``, plain values for ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_ddpx._compat.torch import rank_not_in_group
from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.option_values import check_int

__all__ = [
    "AverageOver",
    "HierarchicalModelAverager",
    "ModelAverager",
    "PeriodicModelAverager",
    "average_parameters",
    "params_to_average",
]

ParamsOrGroups = Iterable[Union[torch.Tensor, Mapping[str, Any]]]


def params_to_average(params: ParamsOrGroups) -> list[torch.Tensor]:
    """The parameters (from ``model.parameters()`` or ``optimizer.param_groups``) that have a gradient."""
    selected: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, torch.Tensor):
            candidates: Iterable[Any] = (item,)
        elif isinstance(item, Mapping) and "params" in item:
            candidates = item["params"]
        else:
            raise TypeError(
                "average_parameters takes parameters (model.parameters()) or parameter groups "
                f"(optimizer.param_groups), got an element of type {type(item).__name__}."
            )
        selected.extend(p for p in candidates if p.grad is not None)
    return selected


def average_parameters(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Replace each parameter by its mean over ``group`` (one allreduce per dtype and device), in place.

    As torch: flatten, divide by the group size, sum-allreduce, copy back. A rank outside ``group`` does
    nothing. Every rank of ``group`` must pass parameters of the same shapes in the same order.
    """
    group = group if group is not None else dist.group.WORLD
    if group is None or rank_not_in_group(group):
        return
    size = dist.get_world_size(group)
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    with torch.no_grad():
        for same_kind in by_kind.values():
            flat = torch.cat([p.detach().reshape(-1) for p in same_kind])
            flat.div_(size)
            with waiting_for("every rank's parameters to average (post-local SGD model averaging)", group):
                dist.all_reduce(flat, group=group)
            offset = 0
            for p in same_kind:
                p.detach().copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def _warn_period_one() -> None:
    warnings.warn(
        "model averaging with period 1 averages parameters after every step, which costs at least as much "
        "as averaging gradients: plain DDP (no post-local SGD) is cheaper. Use a period > 1.",
        UserWarning,
        stacklevel=3,
    )


@dataclass(frozen=True)
class AverageOver:
    """An average due at the current step, over ``group`` (``None``: the default group)."""

    group: dist.ProcessGroup | None


class ModelAverager:
    """Counts optimizer steps and averages parameters when due; subclasses say when and over which group."""

    name = "post-local SGD's model averaging"  # ParameterAveraging: for messages
    docs = "docs/hooks.md (post_local_sgd: on the bare module)"

    def __init__(self, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
        check_int("model averaging", "warmup_steps", warmup_steps, 0)
        self.warmup_steps = int(warmup_steps)
        self.process_group = process_group
        self.step = 0

    def due(self) -> Optional[AverageOver]:
        """The average due at the current step, or ``None``."""
        raise NotImplementedError

    def due_next(self) -> bool:
        """Whether the next :meth:`after_optimizer_step` averages (a collective)."""
        return self.due() is not None

    def average_parameters(self, params: ParamsOrGroups, *, only_with_grad: bool = True) -> bool:
        """torch's call, once after every ``optimizer.step()``; averages ``params`` when due: those with a
        gradient, as torch's averagers do, or all of them (``only_with_grad=False``; ``params`` are then
        tensors). Returns whether it did."""
        return self.after_optimizer_step(
            lambda: params_to_average(params) if only_with_grad else list(params)  # type: ignore[arg-type]
        )

    # ---------------------------------------------------------------------- ParameterAveraging
    def bind(self, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Nothing to keep: each call names the parameters to average."""

    def after_optimizer_step(self, updated: Callable[[], Sequence[torch.Tensor]]) -> bool:
        """Count one optimizer step; when due, average every parameter ``updated()`` gives (asked only
        then). Returns whether it averaged."""
        due = self.due()
        if due is not None:
            average_parameters(updated(), due.group)
        self.step += 1
        return due is not None

    def global_parameters(self) -> ContextManager[None]:
        """No global copy is kept (the replicas meet only at an average): the block changes nothing."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Nothing in flight: each average completes before it returns."""

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        step = state_dict.get("step") if isinstance(state_dict, Mapping) else None
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expects {{'step': n}} with n >= 0 as returned by "
                f"state_dict(), got {state_dict!r}."
            )
        self.step = int(step)


class PeriodicModelAverager(ModelAverager):
    """Average over ``process_group`` (``None``: the default group) every ``period`` steps after warm-up.

    ``warmup_steps`` should equal the hook's ``start_localSGD_iter``: before it gradients are averaged
    globally, so the replicas are identical and averaging them would only cost time.

    Example::

        >>> from lightning_ddpx.hooks import PostLocalSGDState, post_local_sgd_hook
        >>> from lightning_ddpx.hooks.model_averaging import PeriodicModelAverager
        >>> state = PostLocalSGDState(process_group=None, subgroup=1, start_localSGD_iter=100)
        >>> model.register_comm_hook(state, post_local_sgd_hook)  # doctest: +SKIP
        >>> averager = PeriodicModelAverager(period=4, warmup_steps=100)
        >>> for x, y in batches:  # doctest: +SKIP
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()
        ...     averager.average_parameters(model.parameters())  # every 4 steps from step 100
        ...     optimizer.zero_grad()
    """

    def __init__(
        self, period: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None
    ) -> None:
        check_int("model averaging", "period", period, 1)
        super().__init__(warmup_steps, process_group)
        if period == 1:
            _warn_period_one()
        self.period = int(period)

    def due(self) -> Optional[AverageOver]:
        due = self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0
        return AverageOver(self.process_group) if due else None

    def __repr__(self) -> str:
        return (
            f"PeriodicModelAverager(period={self.period}, warmup_steps={self.warmup_steps}, step={self.step})"
        )


class HierarchicalModelAverager(ModelAverager):
    """Average in nested groups at several periods: ``{2: 2, 8: 4}`` on 4 ranks averages pairs every 2
    steps and all four every 8 (only the largest due period runs at a step).

    ``groups`` maps each period to its process group (this rank's subgroup of that size); build it with
    :func:`hierarchy_groups`. Periods must increase and the last group must be the whole ``process_group``.
    """

    def __init__(
        self,
        groups: Mapping[int, dist.ProcessGroup | None],
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not groups:
            raise ValueError(
                "HierarchicalModelAverager: the hierarchy {period: group_size} must not be empty."
            )
        super().__init__(warmup_steps, process_group)
        for period in groups:
            check_int("model averaging", "a hierarchy period", period, 1)
        self.periods = list(groups)
        self.groups = dict(groups)
        if max(self.periods) == 1:
            _warn_period_one()

    def due(self) -> Optional[AverageOver]:
        if self.step < self.warmup_steps:
            return None
        for period in reversed(self.periods):
            if self.step % period == 0:
                return AverageOver(self.groups[period])
        return None

    def __repr__(self) -> str:
        return f"HierarchicalModelAverager(periods={self.periods}, warmup_steps={self.warmup_steps}, step={self.step})"


def check_hierarchy(hierarchy: Mapping[int, int], world_size: int | None = None) -> None:
    """Validate ``{period: group_size}`` (no process group needed; ``world_size`` once it is known)."""
    if not isinstance(hierarchy, Mapping) or not hierarchy:
        raise ValueError(
            f"post_local_sgd option hierarchy must be a non-empty mapping {{period: group_size}}, got {hierarchy!r}."
        )
    periods, sizes = list(hierarchy), list(hierarchy.values())
    for period, size in hierarchy.items():
        check_int("model averaging", "a hierarchy period", period, 1)
        check_int("model averaging", "a hierarchy group size", size, 1)
    if periods != sorted(set(periods)) or sizes != sorted(sizes):
        raise ValueError(
            f"post_local_sgd option hierarchy={dict(hierarchy)!r}: periods must increase, and group sizes must not "
            "decrease with them (larger groups average less often), e.g. {2: 2, 8: 4}."
        )
    if world_size is not None:
        if sizes[-1] != world_size:
            raise ValueError(
                f"post_local_sgd option hierarchy={dict(hierarchy)!r}: the last group size must be the size of "
                f"the whole process group ({world_size}), so that every replica is averaged eventually."
            )
        bad = [size for size in sizes if world_size % size]
        if bad:
            raise ValueError(
                f"post_local_sgd option hierarchy={dict(hierarchy)!r}: group sizes {bad} do not divide the "
                f"process group's size {world_size}; choose divisors of {world_size}."
            )


def hierarchy_groups(
    hierarchy: Mapping[int, int], process_group: dist.ProcessGroup | None = None
) -> dict[int, dist.ProcessGroup | None]:
    """``{period: this rank's group of that size}``: consecutive ranks of ``process_group``. A collective
    (every rank of the default group creates every subgroup); the whole-group size maps to ``process_group``."""
    world_size = dist.get_world_size(process_group)
    check_hierarchy(hierarchy, world_size)
    groups: dict[int, dist.ProcessGroup | None] = {}
    for period, size in hierarchy.items():
        if size == world_size:
            groups[period] = process_group
        else:
            groups[period], _ = dist.new_subgroups(group_size=size, group=process_group)
    return groups
