"""Post-local SGD: average gradients globally for a warm-up, then only within subgroups, plus model averaging.

`Post-local SGD <https://arxiv.org/abs/1808.07217>`_ trains like DDP for ``start_localSGD_iter`` steps; after
that each step only averages gradients within a ``subgroup`` (cheap: typically the ranks of one machine, or
each rank alone), and the replicas -- which now drift apart -- are averaged every ``period`` optimizer steps
by a model averager (:mod:`lightning_ddpx.hooks.model_averaging`). Semantics are torch's ``post_localSGD_hook`` +
``PostLocalSGDState`` + ``PeriodicModelAverager`` (or ``HierarchicalModelAverager`` when a ``hierarchy``
``{period: group_size}`` is given); the state here also owns the averager, so that one ``state_dict()``
carries everything a resume needs (the hook's iteration and the averager's step).

``subgroup=None`` means, as in torch, "the ranks on this machine" -- found by host name, not by
``torch.cuda.device_count()`` (which torch uses, and which fails on CPU). On a single machine that is every
rank, so post-local SGD degenerates to DDP plus redundant averaging; a warning says so, and
``subgroup=1`` (each rank alone: plain local SGD) or a group size simulates several machines.
"""

from __future__ import annotations

import numbers
import socket
import warnings
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.buckets.grad_bucket import collectives_issued_on_call, record_bytes_sent
from lightning_ddpx.engine.option_values import check_int
from lightning_ddpx.hooks.default import allreduce_hook
from lightning_ddpx.hooks.model_averaging import (
    HierarchicalModelAverager,
    ModelAverager,
    PeriodicModelAverager,
    check_hierarchy,
    hierarchy_groups,
)

__all__ = ["PostLocalSGDOptions", "PostLocalSGDState", "from_torch_state", "post_local_sgd_hook"]

_STATE_DICT_VERSION = 1


@dataclass(frozen=True)
class PostLocalSGDOptions:
    """Post-local SGD settings (``PostLocalSGDState`` minus the process groups), for YAML and the CLI."""

    # Optimizer steps of global gradient averaging (plain DDP) before local SGD starts (torch: required).
    start_localSGD_iter: int = 1000
    # Steps between global model averages after that; None: the strategy's model_averaging_period.
    period: Optional[int] = None
    # Ranks per gradient-averaging subgroup after the warm-up; None: the ranks on this machine; 1: none.
    subgroup: Optional[int] = None
    # {period: group_size}, periods increasing, last size = world size: hierarchical averaging, replaces period.
    hierarchy: Optional[dict[int, int]] = None
    # Keep averaging gradients within the subgroup after the warm-up (False: no gradient communication).
    post_local_gradient_allreduce: bool = True

    def __post_init__(self) -> None:
        check_int("PostLocalSGDOptions", "start_localSGD_iter", self.start_localSGD_iter, 0)
        check_int("PostLocalSGDOptions", "period", self.period, 1, optional=True)
        check_int("PostLocalSGDOptions", "subgroup", self.subgroup, 1, optional=True)
        if not isinstance(self.post_local_gradient_allreduce, bool):
            raise TypeError(
                "post_local_sgd option post_local_gradient_allreduce must be True or False, got "
                f"{self.post_local_gradient_allreduce!r}."
            )
        if self.hierarchy is not None:
            hierarchy = _int_keys(self.hierarchy)
            check_hierarchy(hierarchy)
            object.__setattr__(self, "hierarchy", hierarchy)
            if self.period is not None:
                raise ValueError(
                    f"post_local_sgd options period={self.period} and hierarchy={hierarchy} both say when to "
                    "average; give one (the hierarchy's largest period is the global one)."
                )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PostLocalSGDOptions:
        """Build from a plain mapping (a YAML section), naming unknown keys and the valid ones."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown post_local_sgd option(s) {unknown}; valid options are {valid} (process groups are "
                "passed separately: PostLocalSGDState(process_group, subgroup, ...))."
            )
        return cls(**values)

    def with_period(self, period: Optional[int]) -> PostLocalSGDOptions:
        """These options with ``period`` filled in from the strategy's ``model_averaging_period``."""
        if period is None or period == self.period:
            return self
        if self.period is not None or self.hierarchy is not None:
            given = f"period={self.period}" if self.period is not None else f"hierarchy={self.hierarchy}"
            raise ValueError(
                f"DDPXStrategy: model_averaging_period={period} conflicts with post_local_sgd {given}; "
                "give the averaging period in one place."
            )
        check_int("DDPXStrategy", "model_averaging_period", period, 1)
        return PostLocalSGDOptions(**{**self.__dict__, "period": period})


def _int_keys(hierarchy: Any) -> dict[int, int]:
    """YAML and the CLI may give keys as strings ("4": 8); accept those that are integers."""
    if not isinstance(hierarchy, Mapping):
        if isinstance(hierarchy, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in hierarchy
        ):
            hierarchy = dict(hierarchy)
        else:
            raise TypeError(
                f"post_local_sgd option hierarchy must be a mapping {{period: group_size}}, got {hierarchy!r}."
            )
    out: dict[int, int] = {}
    for key, value in hierarchy.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        out[key] = value
    return out


class PostLocalSGDState:
    """State of :func:`post_local_sgd_hook`, with torch's constructor (plus ``period``/``hierarchy``).

    Args:
        process_group: the global group (``None``: the default group).
        subgroup: the group gradients are averaged in after the warm-up: a ``ProcessGroup``, a group size
            (consecutive ranks), or ``None`` for the ranks on this machine.
        start_localSGD_iter: synchronised backward passes of global averaging before local SGD starts.
        post_local_gradient_allreduce: average gradients within ``subgroup`` after the warm-up (torch's).
        period: build a :class:`~lightning_ddpx.hooks.model_averaging.PeriodicModelAverager` (``state.averager``)
            averaging every ``period`` steps after ``start_localSGD_iter``.
        hierarchy: ``{period: group_size}``: build a ``HierarchicalModelAverager`` instead.

    Groups (the subgroup, the hierarchy's groups) are created at once if the default process group exists,
    otherwise at the first hook call; creating them is a collective of every rank.
    ``state_dict()`` is ``{"shared": {"iter", "averager_step", ...}, "per_rank": {}}``.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup],
        subgroup: Union[dist.ProcessGroup, int, None],
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
        *,
        period: Optional[int] = None,
        hierarchy: Optional[Mapping[int, int]] = None,
    ) -> None:
        # Validation is the options' (one place for messages); a ProcessGroup subgroup is checked here.
        options = PostLocalSGDOptions(
            start_localSGD_iter=start_localSGD_iter,
            period=period,
            subgroup=subgroup if not isinstance(subgroup, dist.ProcessGroup) else None,
            hierarchy=dict(hierarchy) if hierarchy is not None else None,
            post_local_gradient_allreduce=post_local_gradient_allreduce,
        )
        self.process_group = process_group
        self.subgroup: Union[dist.ProcessGroup, int, None] = subgroup
        self.start_localSGD_iter = int(start_localSGD_iter)
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.period = options.period
        self.hierarchy = options.hierarchy
        # Synchronised backward passes seen, counted up to start_localSGD_iter (then it stays, as torch's).
        self.iter = 0
        self.averager: Optional[ModelAverager] = None
        self._subgroup_group: Optional[dist.ProcessGroup] = (
            subgroup if isinstance(subgroup, dist.ProcessGroup) else None
        )
        self._pending_averager_step: Optional[int] = None
        self._resolved = False
        if dist.is_available() and dist.is_initialized():
            self.resolve()

    @classmethod
    def from_options(
        cls, options: Optional[PostLocalSGDOptions], process_group: Optional[dist.ProcessGroup] = None
    ) -> PostLocalSGDState:
        options = options if options is not None else PostLocalSGDOptions()
        return cls(
            process_group,
            options.subgroup,
            options.start_localSGD_iter,
            options.post_local_gradient_allreduce,
            period=options.period,
            hierarchy=options.hierarchy,
        )

    # ------------------------------------------------------------------------------------------ groups
    @property
    def local_sgd_started(self) -> bool:
        return self.iter >= self.start_localSGD_iter

    def resolve(self) -> None:
        """Create the subgroup and the averager's groups (a collective on every rank), once."""
        if self._resolved:
            return
        group_size = dist.get_world_size(self.process_group)
        whole = self.process_group is None or group_size == dist.get_world_size()
        if self._subgroup_group is None and self.subgroup != group_size:
            if not whole:
                raise ValueError(
                    "post_local_sgd: with a process_group smaller than the world, pass subgroup as a "
                    "ProcessGroup (dist.new_group(...)); group sizes and subgroup=None need the whole world."
                )
            self._subgroup_group = _make_subgroup(self.subgroup, group_size)
        elif self._subgroup_group is None:
            self._subgroup_group = self.process_group
        if self.hierarchy is not None and not whole:
            raise ValueError(
                "post_local_sgd: hierarchy needs process_group=None (the whole world); with a smaller "
                "group build lightning_ddpx.hooks.model_averaging.HierarchicalModelAverager yourself."
            )
        self._resolved = True
        self._build_averager()

    def set_period(self, period: int) -> None:
        """Average every ``period`` steps (the strategy's ``model_averaging_period`` for a state given
        without one)."""
        if self.hierarchy is not None or (self.period is not None and self.period != period):
            raise ValueError(
                f"post_local_sgd: model_averaging_period={period} conflicts with the state's own averaging "
                f"(period={self.period}, hierarchy={self.hierarchy}); give the averaging period in one place."
            )
        check_int("PostLocalSGDState", "period", period, 1)
        self.period = int(period)
        if self._resolved and self.averager is None:
            self._build_averager()

    def _build_averager(self) -> None:
        if self.hierarchy is not None:
            groups = hierarchy_groups(self.hierarchy, self.process_group)  # a collective
            self.averager = HierarchicalModelAverager(groups, self.start_localSGD_iter, self.process_group)
        elif self.period is not None:
            self.averager = PeriodicModelAverager(self.period, self.start_localSGD_iter, self.process_group)
        if self.averager is not None and self._pending_averager_step is not None:
            self.averager.step = self._pending_averager_step
            self._pending_averager_step = None

    def parameter_averaging(self) -> Optional[ModelAverager]:
        """The averager the module runs at ``model.average_parameters_after_step()`` (``None`` without a
        ``period`` or ``hierarchy``: average by hand then, as with torch's state). Creates the groups first if
        they are not made yet (a collective: every rank registers its hook)."""
        self.resolve()
        return self.averager

    def regroup(self) -> None:
        """Make this rank's gradient subgroup again over the default group, which was rebuilt (a
        fault-tolerant run's membership changed); a collective, on every member. The counters and the
        averager stay. A subgroup given as a ``ProcessGroup`` cannot follow: it is the caller's."""
        if isinstance(self.subgroup, dist.ProcessGroup):
            raise ValueError(
                "post_local_sgd: a subgroup given as a ProcessGroup cannot follow a new membership; give its "
                "size (subgroup=1: every rank on its own)."
            )
        group_size = dist.get_world_size(self.process_group)
        self._subgroup_group = (
            _make_subgroup(self.subgroup, group_size) if self.subgroup != group_size else self.process_group
        )

    @property
    def subgroup_process_group(self) -> Optional[dist.ProcessGroup]:
        """The group gradients are averaged in after the warm-up (once resolved)."""
        return self._subgroup_group

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, dict[str, Any]]:
        averager_step = self.averager.step if self.averager is not None else self._pending_averager_step
        return {
            "shared": {
                "version": _STATE_DICT_VERSION,
                "iter": self.iter,
                "averager_step": averager_step,
                "start_localSGD_iter": self.start_localSGD_iter,
            },
            "per_rank": {},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        shared = state_dict.get("shared") if isinstance(state_dict, Mapping) else None
        if not isinstance(shared, Mapping) or shared.get("version") != _STATE_DICT_VERSION:
            raise ValueError(
                "PostLocalSGDState.load_state_dict expects {'shared': {'version': 1, 'iter': ..., "
                f"'averager_step': ...}}, 'per_rank': {{}}}} as returned by state_dict(), got {state_dict!r}."
            )
        iteration, step = shared.get("iter"), shared.get("averager_step")
        for name, value in (("iter", iteration), ("averager_step", step)):
            if value is None and name == "averager_step":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(
                    f"PostLocalSGDState.load_state_dict: {name} must be an integer >= 0, got {value!r}."
                )
        # iter never passes start_localSGD_iter (torch's counter stops there); clamp if the option changed.
        self.iter = min(int(iteration), self.start_localSGD_iter)
        if step is not None:
            if self.averager is not None:
                self.averager.step = int(step)
            else:
                self._pending_averager_step = int(step)

    def __repr__(self) -> str:
        return (
            f"PostLocalSGDState(start_localSGD_iter={self.start_localSGD_iter}, iter={self.iter}, "
            f"subgroup={self.subgroup!r}, period={self.period}, hierarchy={self.hierarchy}, "
            f"averager={self.averager!r})"
        )


def _make_subgroup(size: Optional[int], world_size: int) -> dist.ProcessGroup:
    """This rank's gradient subgroup: ``size`` consecutive ranks, or (``None``) the ranks on this host."""
    if size is not None:
        if world_size % size:
            raise ValueError(
                f"post_local_sgd option subgroup={size} does not divide the world size {world_size}; choose a "
                f"divisor of {world_size} (1: every rank on its own), or None for the ranks on each machine."
            )
        group, _ = dist.new_subgroups(group_size=size)
        return group
    hosts: list[Any] = [None] * world_size
    with waiting_for(
        "every rank's host name, to group ranks by machine (post_local_sgd subgroup=None)", None
    ):
        dist.all_gather_object(hosts, socket.gethostname())
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    if len(by_host) == 1 and world_size > 1:
        if dist.get_rank() == 0:
            warnings.warn(
                f"post_local_sgd: subgroup=None means the ranks on each machine, and all {world_size} ranks run "
                "on one machine, so gradients stay averaged over every rank after start_localSGD_iter: this is "
                "plain DDP plus redundant model averaging. Set subgroup=1 (each rank alone: local SGD) or a "
                "group size that divides the world size to simulate several machines.",
                UserWarning,
                stacklevel=4,
            )
        return dist.group.WORLD  # type: ignore[return-value]
    group, _ = dist.new_subgroups_by_enumeration(list(by_host.values()))
    return group


@collectives_issued_on_call
def post_local_sgd_hook(
    state: PostLocalSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``state.process_group`` before ``start_localSGD_iter``, then over the subgroup.

    Pair it with ``model.average_parameters_after_step()`` after every ``optimizer.step()`` (the strategies
    do this for you; torch's ``state.averager.average_parameters(model.parameters())`` works too). Each
    collective is issued before returning, so the hook runs inline.
    """
    state.resolve()
    if state.iter < state.start_localSGD_iter:
        if bucket.is_last():
            state.iter += 1
        return allreduce_hook(state.process_group, bucket)
    subgroup = state.subgroup_process_group
    if not state.post_local_gradient_allreduce or dist.get_world_size(subgroup) == 1:
        record_bytes_sent(bucket, 0)  # nothing sent (statistics then say 0, not "unknown")
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    return allreduce_hook(subgroup, bucket)


def from_torch_state(torch_state: Any, period: Optional[int]) -> PostLocalSGDState:
    """Our state from torch's ``PostLocalSGDState`` (its groups, start and iteration), averaging every
    ``period`` steps -- how ``DDPXStrategy(comm_hook=torch's post_localSGD_hook, comm_state=torch's state,
    model_averaging_period=N)`` runs, checkpointed like the named hook."""
    state = PostLocalSGDState(
        torch_state.process_group,
        torch_state.subgroup,
        torch_state.start_localSGD_iter,
        torch_state.post_local_gradient_allreduce,
        period=period,
    )
    state.iter = torch_state.iter
    return state
