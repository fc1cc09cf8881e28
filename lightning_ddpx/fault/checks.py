"""What fault tolerance cannot follow across a membership change, refused by name before the first step.

One message per rule, for every caller: the strategies' options
(:func:`~lightning_ddpx.lightning.settings.fault_tolerance_options.check_options`), the bare module's
:meth:`~lightning_ddpx.fault.manager.FaultTolerance.wrap`, and the model at the first step.
"""

from __future__ import annotations

from typing import Any

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel
from lightning_ddpx.engine.transport.transports import hook_name
from lightning_ddpx.hooks.post_local_sgd import PostLocalSGDOptions, PostLocalSGDState

__all__ = [
    "SUPPORTED_HOOKS",
    "check_attached_hook",
    "check_averaging_options",
    "check_backend",
    "check_hook",
    "check_post_local_sgd_options",
    "check_trackable",
    "check_wrap_options",
    "refuse_join",
    "refuse_unsupported_hook",
    "refuse_unsupported_model",
]

# Hooks that follow a membership change: the stateless ones (their only state is the default group, which
# each membership rebuilds), PowerSGD, whose shared state is rolled back and handed on, and DiLoCo and
# post-local SGD, whose averaging is snapshotted, voted on and retried over the survivors
# (lightning_ddpx.fault.hook_state); their newcomers are healed as copies of a live replica.
SUPPORTED_HOOKS = (
    "allreduce",
    "bf16",
    "fp16",
    "noop",
    "powersgd",
    "batched_powersgd",
    "diloco",
    "post_local_sgd",
)


def check_backend(backend: str, who: str = "FaultTolerance", option: str = "backend") -> None:
    """Refuse a process group backend whose groups cannot be rebuilt after a lost rank: the one rule for the
    bare module (``FaultTolerance(backend=...)``) and both strategies (``who="DDPXStrategy"``,
    ``option="process_group_backend"``), each naming its own option."""
    if backend != "gloo":
        raise ValueError(
            f"{who}: fault_tolerance needs the gloo backend ({option}='gloo'), got {backend!r}: only gloo's "
            "groups can be rebuilt after a lost rank."
        )


def refuse_unsupported_hook(comm_hook: Any) -> None:
    """Refuse a hook fault tolerance cannot follow across a membership change: the one message for the
    strategies' options and for :meth:`~lightning_ddpx.fault.manager.FaultTolerance.wrap`."""
    if comm_hook is None or (isinstance(comm_hook, str) and comm_hook in SUPPORTED_HOOKS):
        return
    name = (
        comm_hook if isinstance(comm_hook, str) else getattr(comm_hook, "__name__", type(comm_hook).__name__)
    )
    raise ValueError(
        f"lightning_ddpx fault tolerance: comm_hook={name!r} is not supported with fault tolerance; the "
        f"supported hooks are {list(SUPPORTED_HOOKS)} (with or without comm_wrapper); a hook of your own keeps "
        "state the fault tolerance cannot roll back or hand on, and is refused rather than half-working."
    )


def check_hook(comm_hook: str | None, comm_wrapper: str | None) -> None:
    refuse_unsupported_hook(comm_hook)
    if comm_wrapper is not None and comm_hook is None:
        raise ValueError("lightning_ddpx fault tolerance: comm_wrapper needs a comm_hook to wrap.")


def check_wrap_options(ddp_options: dict[str, Any]) -> None:
    for refused in ("process_group", "init_sync"):
        if refused in ddp_options:
            raise ValueError(
                f"lightning_ddpx fault tolerance: wrap() sets {refused} itself (the group changes with the "
                "membership; the replicas are made equal at the first step)."
            )


def check_averaging_options(comm_hook: str | None, post_local_sgd: Any) -> None:
    """Post-local SGD's options (a dict or the options type), refused by name before its subgroups exist.
    Every DiLoCo option is supported (:class:`~lightning_ddpx.fault.hook_state.HookState`)."""
    if comm_hook == "post_local_sgd":
        given = post_local_sgd if post_local_sgd is not None else {}
        options = PostLocalSGDOptions(**given) if isinstance(given, dict) else given
        check_post_local_sgd_options(options.subgroup, options.hierarchy, options.period)


def check_post_local_sgd_options(subgroup: Any, hierarchy: Any, period: Any) -> None:
    """Post-local SGD follows a membership change with ``subgroup=1`` (each rank its own subgroup: the one
    size that divides every world size) or ``subgroup=None`` (the ranks on each machine, found again for
    each membership), no ``hierarchy`` (its groups' sizes are the old world's) and a ``period`` (the
    averages the fault tolerance votes on; averaging by hand it cannot see)."""
    for name, value, wanted, allowed in (
        ("subgroup", subgroup, "subgroup=1 or None (the ranks on each machine)", subgroup in (1, None)),
        ("hierarchy", hierarchy, "no hierarchy", hierarchy is None),
        ("period", period, "a period", period is not None),
    ):
        if not allowed:
            raise ValueError(
                f"lightning_ddpx fault tolerance: post-local SGD with {name}={value!r} is not supported; use "
                f"{wanted} (a membership change leaves other subgroups and hierarchies stale, and averages "
                "made by hand are not voted on)."
            )


def check_attached_hook(model: DistributedDataParallel, comm_hook: str | None) -> None:
    """A model handed to ``attach`` carries the hook named ``comm_hook`` (registered by the one route that
    builds hooks, :func:`~lightning_ddpx.hooks.build_comm_hook`, e.g. through ``DDPXConfig.register_hook``),
    or none when ``comm_hook`` is ``None``; a post-local SGD state's options are checked on the state."""
    refuse_unsupported_hook(comm_hook)
    if (model.comm_hook is None) != (comm_hook is None):
        registered = "no hook" if model.comm_hook is None else "a hook"
        raise ValueError(
            f"lightning_ddpx fault tolerance: attach(comm_hook={comm_hook!r}) was given a model with "
            f"{registered} registered; register the named hook first (build_comm_hook, or the strategy's "
            "DDPXConfig.register_hook) and name it here."
        )
    state = model.comm_hook_state
    if isinstance(state, PostLocalSGDState):
        check_post_local_sgd_options(state.subgroup, state.hierarchy, state.period)


def refuse_unsupported_model(model: DistributedDataParallel, hook: Any) -> None:
    """What cannot survive a membership change, refused by name before the first step: a hook registered
    on the model other than ``hook`` (the one ``wrap``/``attach`` adopted), or parameters updated during
    backward (before the members agree whether the step counts)."""
    if model.comm_hook is not None and model.comm_hook is not hook:
        raise ValueError(
            f"lightning_ddpx fault tolerance: the model has a communication hook ({hook_name(model.comm_hook)}) "
            f"registered outside wrap(); pass comm_hook= to wrap() (supported: {list(SUPPORTED_HOOKS)})."
        )
    if model.updates_parameters_in_backward:
        raise ValueError(
            "lightning_ddpx fault tolerance: the optimizer overlap (or an optimizer in backward) updates "
            "parameters during backward, before the members agree whether the step counts, so a discarded "
            "step could not be undone; train without it."
        )


def refuse_join(model: DistributedDataParallel) -> None:
    """``model.join()`` (uneven inputs) cannot follow a membership change; checked by every member alike,
    before any collective of the step."""
    if model.inside_join:
        raise ValueError(
            "lightning_ddpx fault tolerance: model.join() (uneven inputs) is not supported: a joined rank "
            "shadows the others' collectives outside the steps the members agree on, and a membership "
            "change would leave its count stale. Key the data on ft.steps_committed, ft.rank and "
            "ft.world_size instead: every member then runs the same steps, and a lost rank's share goes "
            "to the survivors."
        )


def check_trackable(obj: Any) -> None:
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(
            f"lightning_ddpx fault tolerance: track() takes objects with state_dict() and "
            f"load_state_dict(), got {type(obj).__name__}."
        )
