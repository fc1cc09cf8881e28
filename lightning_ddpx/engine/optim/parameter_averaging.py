"""Parameter averaging: after each optimizer step, maybe change the parameters across ranks.

Post-local SGD's model averaging and DiLoCo's outer step are not communication hooks. A hook reduces
gradients during backward; these run after ``optimizer.step()`` and change the parameters themselves
(average them every ``period`` steps; or step a global model with the ranks' mean change and restart every
replica from it). Their hook lets the ranks' gradients stay apart (after a warm-up, or always), so without
this step each rank trains alone. :class:`ParameterAveraging` is what such an algorithm offers. A hook state
that needs one brings it (its ``parameter_averaging()`` method; the implementations live in
:mod:`lightning_ddpx.hooks`), and the module and the strategies drive it through this protocol only:

- :meth:`DistributedDataParallel.register_comm_hook` binds it to the module's parameters
  (``register_parameter_averaging`` for an algorithm that comes without a hook);
- ``model.average_parameters_after_step()`` runs it after each ``optimizer.step()``; the strategies call
  the same method;
- :class:`BoundAveraging` refuses the next synchronising forward after an optimizer step that skipped it,
  on every rank alike, instead of letting the replicas drift apart in silence.

The guard's cost: one global optimizer step post-hook (``register_optimizer_step_post_hook``), installed only
while a module has parameter averaging, which looks the stepping optimizer up in a small cache; and one
comparison of two integers per synchronising forward. A module without parameter averaging installs nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, ContextManager, Iterable, Mapping, Optional, Protocol, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["BoundAveraging", "ParameterAveraging", "parameter_averaging_of", "parameters_updated_by"]


class ParameterAveraging(Protocol):
    """An algorithm that, after each optimizer step, may change the parameters across ranks.

    Implemented by post-local SGD's model averagers (:mod:`lightning_ddpx.hooks.model_averaging`) and
    DiLoCo's outer step (:class:`lightning_ddpx.hooks.diloco.OuterStep`).
    """

    name: str  # what messages call it, e.g. "DiLoCo's outer step"
    docs: str  # where its use on the bare module is documented
    step: int  # optimizer steps it has counted (a resumed run restores it)

    def bind(self, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Take the module's parameters, once every rank holds rank 0's values (at hook registration).
        An algorithm that averages what each call names (post-local SGD) keeps nothing."""

    def after_optimizer_step(self, updated: Callable[[], Sequence[torch.Tensor]]) -> bool:
        """Count one optimizer step; when due, change parameters across ranks -- a collective, every rank
        calls it after the same steps. ``updated()`` gives the module's parameters the optimizers update (asked
        only when needed); an algorithm that owns its parameter list (DiLoCo) does not ask. Returns whether it
        changed the parameters."""

    def global_parameters(self) -> ContextManager[None]:
        """Inside the block, the parameters hold the global model, equal on every rank, where the algorithm
        keeps one (DiLoCo's anchors); restored on exit. Without one (post-local SGD), the block changes
        nothing."""

    def finish(self) -> None:
        """Wait for exchanges still in flight (at the end of training, before the process group goes)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, tensors and plain values only."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...


def parameter_averaging_of(hook_state: Any) -> Optional[ParameterAveraging]:
    """The algorithm a hook state brings (its ``parameter_averaging()``), or ``None``, as for most hooks."""
    bring = getattr(hook_state, "parameter_averaging", None)
    return bring() if callable(bring) else None


def parameters_updated_by(optimizers: Iterable[Any], own: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor of ``own`` that one of ``optimizers`` holds, once, in the optimizers' order."""
    ids = {id(p) for p in own}
    seen: set[int] = set()
    chosen: list[torch.Tensor] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in ids and id(param) not in seen:
                    seen.add(id(param))
                    chosen.append(param)
    return chosen


def skipped_message(algorithm: ParameterAveraging, rank: int) -> str:
    return (
        f"lightning_ddpx (rank {rank}): the registered communication hook comes with {algorithm.name}, which "
        "must run after every optimizer step, but optimizer.step() updated this model's parameters and it did "
        "not run before this forward. Without it each rank trains alone and the replicas drift apart. Call "
        "model.average_parameters_after_step() after every optimizer.step() (the Lightning strategies do "
        f"this for you). See {algorithm.docs}."
    )


class BoundAveraging:
    """A :class:`ParameterAveraging` bound to one module: runs it, and guards that it runs.

    An optimizer step "updates the module" when the optimizer holds one of its parameters; a global step
    post-hook counts those steps. At the next synchronising forward, if some were counted while the algorithm
    counted none (its ``step`` did not move: neither :meth:`run` nor the algorithm's own call, such as
    post-local SGD's ``state.averager.average_parameters(...)``, ran), :meth:`check_before_sync` raises. The
    facts are the training loop's, the same on every rank, and the check comes before the forward's first
    collective: every rank raises there, none is left waiting.
    """

    def __init__(self, algorithm: ParameterAveraging, named_parameters: Sequence[tuple[str, torch.Tensor]]):
        algorithm.bind(named_parameters)
        self.algorithm = algorithm
        self._own = [p for _, p in named_parameters]
        self._own_ids = frozenset(id(p) for p in self._own)
        # id(optimizer) -> (the optimizer, weakly; its number of parameter groups then; whether it holds ours)
        self._holders: dict[int, tuple[weakref.ref, int, bool]] = {}
        self._steps_since_check = 0  # steps of optimizers holding the module's parameters
        self._counted_at_check = algorithm.step
        this = weakref.ref(self)  # the global hook must not keep the module alive

        def on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            bound = this()
            if bound is not None:
                bound._optimizer_stepped(optimizer)

        handle = register_optimizer_step_post_hook(on_step)
        self._remove_hook = weakref.finalize(self, handle.remove)  # at close, or when collected

    def close(self) -> None:
        """Stop watching optimizer steps (the module is closed)."""
        self._remove_hook()

    def _optimizer_stepped(self, optimizer: Any) -> None:
        groups = optimizer.param_groups
        entry = self._holders.get(id(optimizer))
        if entry is None or entry[0]() is not optimizer or entry[1] != len(groups):
            holds = any(id(p) in self._own_ids for group in groups for p in group["params"])
            self._holders = {k: v for k, v in self._holders.items() if v[0]() is not None}
            entry = self._holders[id(optimizer)] = (weakref.ref(optimizer), len(groups), holds)
        if entry[2]:
            self._steps_since_check += 1

    def run(self, optimizers: Optional[Iterable[Any]] = None) -> bool:
        """One optimizer step's worth of the algorithm, over the module's parameters that ``optimizers``
        update (``None``: every parameter with ``requires_grad``), gathered only if the algorithm asks."""
        if optimizers is None:
            return self.algorithm.after_optimizer_step(lambda: [p for p in self._own if p.requires_grad])
        chosen = list(optimizers)
        return self.algorithm.after_optimizer_step(lambda: parameters_updated_by(chosen, self._own))

    def check_before_sync(self, rank: int) -> None:
        """Raise if an optimizer step updated the module since the last check and the algorithm did not run."""
        if self._steps_since_check and self.algorithm.step == self._counted_at_check:
            raise RuntimeError(skipped_message(self.algorithm, rank))
        self._steps_since_check, self._counted_at_check = 0, self.algorithm.step
