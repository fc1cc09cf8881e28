"""The optimizer step overlapped with communication: each bucket's parameters step as soon as it is reduced.

Without overlap, the end of backward waits for every bucket, writes every averaged gradient, and only then
does ``optimizer.step()`` update all parameters. With :meth:`DistributedDataParallel.overlap_optimizer_with
<lightning_ddpx.engine.module.data_parallel.DistributedDataParallel.overlap_optimizer_with>`, the end of backward walks the
buckets in launch order: wait for bucket ``b``, write its gradients into ``param.grad``, step the optimizer for
its parameters -- while buckets ``b+1 ...`` are still being reduced on the communication threads. The update
of the early buckets then hides behind the communication of the late ones. The last bucket, with nothing
left to hide behind, is planned small (the first bucket's cap). On the CPU, parameters longer than that cap
are updated in cache-sized slices (:mod:`lightning_ddpx.engine.optim.piecewise_step`): same values, faster where
measured (docs/benchmarks.md); on CUDA, where it is not measured, they are updated whole.

The overlap walks the same path as the reducer's own finalize (:mod:`lightning_ddpx.engine.reducer.results_in_order`:
bucket results in launch order, the used-parameter counts, the seconds spent waiting) and writes each bucket
back through the reducer (``write_back``).

Why a *view* of the user's optimizer rather than a second optimizer (torch's private
``_register_fused_optim`` builds a functional copy with its own state):

- the view has the user's class, so it runs exactly the same update code (``foreach``/``fused`` choices
  included); an update of parameter ``p`` reads only ``p``, ``p.grad``, ``state[p]`` and its group's
  options for the optimizers accepted here, so stepping the parameters in bucket-sized groups gives the
  parameters the plain step gives;
- it shares the user's ``state`` dict (read anew at every step, as ``load_state_dict`` replaces it), so
  ``optimizer.state_dict()``, checkpoints and resume work unchanged;
- its ``param_groups`` are built at every step from the user's live groups, filtered to the bucket's
  parameters, so a learning-rate scheduler's change of ``lr`` applies at the next step.

What cannot work this way is refused by :func:`check_overlappable` with the reason: optimizers whose update
of one parameter depends on other parameters' gradients (LBFGS, anything with a closure or a global norm),
and step hooks (they expect one ``step()`` over all parameters). Gradient clipping needs every gradient
before any update: it is the caller's to refuse (the Lightning strategies do).

Parameters unused on every rank (``find_unused_parameters``) are known only when the used-parameter bitmap
arrives, after the last bucket: a bucket's parameters that were used on this rank step at once (they are
used somewhere, so their averaged gradient is written), the others wait for the bitmap, then get the plain
treatment (gradient written only if some rank used the parameter; a ``None`` gradient is skipped by the
optimizer, as in the plain step). So find_unused_parameters reduces the overlap only for parameters this
rank did not use.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from lightning_ddpx._compat.torch import (
    global_optimizer_hooks_once,
    has_step_hooks,
    mark_stepped_for_lr_scheduler,
)
from lightning_ddpx.engine.buckets.plan import chunk_ranges
from lightning_ddpx.engine.optim.piecewise_step import PiecewiseStep, optimizer_view, steps_in_pieces
from lightning_ddpx.engine.profiling import label

if TYPE_CHECKING:
    from lightning_ddpx.engine.reducer.reducer import Reducer
    from lightning_ddpx.engine.reducer.results_in_order import ResultsInOrder

__all__ = ["OptimizerOverlap", "check_overlappable", "per_parameter_optimizers"]


def per_parameter_optimizers() -> tuple[type[torch.optim.Optimizer], ...]:
    """torch's optimizers whose update of a parameter depends on that parameter's gradient and state only."""
    names = (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "Adadelta",
        "Adagrad",
        "Adafactor",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
    )
    return tuple(getattr(torch.optim, name) for name in names if hasattr(torch.optim, name))


def _accepted_base(cls: type) -> type | None:
    """The accepted torch class ``cls`` derives from without overriding ``step`` on the way, else ``None``."""
    accepted = per_parameter_optimizers()
    for klass in cls.__mro__:
        if klass in accepted:
            return klass
        if "step" in vars(klass):
            return None
    return None


def check_overlappable(optimizer: Any, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
    """Refuse, naming the optimizer and why, what cannot be stepped bucket by bucket (module's ``params``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "lightning_ddpx: overlap_optimizer_with needs a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}. Pass the optimizer that steps this module's parameters."
        )
    cls = type(optimizer)
    if _accepted_base(cls) is None:
        why = (
            "it needs a closure that re-evaluates the loss and sees all gradients at once"
            if isinstance(optimizer, torch.optim.LBFGS)
            else "it is not one of torch's per-parameter optimizers, or overrides step(), so an update of one "
            "parameter may depend on other parameters' gradients (a global norm, a trust ratio, a closure)"
        )
        accepted = ", ".join(klass.__name__ for klass in per_parameter_optimizers())
        raise TypeError(
            f"lightning_ddpx: overlap_optimizer cannot step {cls.__module__}.{cls.__qualname__} bucket by "
            f"bucket: {why}. Supported: {accepted} (and subclasses that do not override step()). Use the plain "
            "optimizer.step() after backward for this optimizer (overlap_optimizer=False)."
        )
    if has_step_hooks(optimizer):
        raise ValueError(
            f"lightning_ddpx: overlap_optimizer cannot step {cls.__name__} bucket by bucket while it has step "
            "pre/post hooks (register_step_pre_hook / register_step_post_hook): they expect one step() over "
            "all parameters. Remove the hooks, or keep the plain optimizer.step() (overlap_optimizer=False)."
        )
    ours = {id(p) for p in params}
    foreign = [
        i
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if p.requires_grad and id(p) not in ours
    ]
    if foreign:
        raise ValueError(
            f"lightning_ddpx: the optimizer given to overlap_optimizer_with holds {len(foreign)} trainable "
            "parameter(s) that this DistributedDataParallel does not reduce, so no bucket would ever step "
            f"them (this module's parameters start with {list(names[:3])}). Give the overlap an optimizer of "
            "this module's parameters only, or keep the plain optimizer.step()."
        )


def _live_grad_scalers() -> list[Any]:
    """Enabled ``torch.amp.GradScaler`` instances (subclasses included) alive in this process.

    Nothing tells a backward that its loss was scaled, so the instances are looked up through the garbage
    collector's referrers of their classes: one scan of the tracked objects (tens of milliseconds), run once
    per overlap, before its first update."""
    import gc

    classes, todo = [], [torch.amp.GradScaler]
    while todo:
        klass = todo.pop()
        classes.append(klass)
        todo.extend(klass.__subclasses__())
    found = [obj for obj in gc.get_referrers(*classes) if isinstance(obj, torch.amp.GradScaler)]
    return [scaler for scaler in found if scaler.is_enabled()]


def refuse_grad_scaler(optimizer: torch.optim.Optimizer) -> None:
    """Refuse the overlap while an enabled GradScaler exists: its gradients are scaled until
    ``scaler.step`` unscales them and checks for inf/NaN, which needs every gradient before any update."""
    scalers = _live_grad_scalers()
    if scalers:
        raise RuntimeError(
            f"lightning_ddpx: overlap_optimizer_with({type(optimizer).__name__}) and an enabled "
            f"torch.amp.GradScaler ({len(scalers)} alive) do not go together: the overlap updates each bucket "
            "inside backward, from gradients the scaler has scaled and not yet checked for inf/NaN (the update "
            "would be scale times too large). Nothing was updated. Use the plain step "
            "(model.overlap_optimizer_with(None), then scaler.step(optimizer)), bfloat16 autocast without a "
            "scaler, or GradScaler(enabled=False)."
        )


class OptimizerOverlap:
    """Writes back and steps bucket by bucket at the end of a synchronised backward (installed on a reducer).

    Phases per synchronised backward: the reducer launches buckets during backward as usual; at its end,
    :meth:`write_back_and_step` waits for each bucket in launch order, writes its gradients and steps the
    view for its parameters. Between that backward and the next forward, :attr:`stepped` is true and the
    user's ``optimizer.step()`` raises (it would apply the update twice).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, reducer: Reducer, slice_bytes: int | None | str = "auto"
    ) -> None:
        check_overlappable(optimizer, reducer.params, reducer.names)
        self.optimizer = optimizer
        self.reducer = reducer
        # Parameters longer than this are updated slice by slice ("auto": the first bucket's cap on the CPU,
        # where slices were measured to pay; never on CUDA, where they are not measured; None: never).
        if slice_bytes == "auto":
            on_cpu = all(p.device.type == "cpu" for p in reducer.params)
            slice_bytes = reducer.first_cap_bytes if on_cpu else None
        self.slice_bytes: int | None = slice_bytes  # type: ignore[assignment]
        self.last_optimizer_s = 0.0  # time spent in bucket steps in the last synchronised backward
        # parameters updated slice by slice (engine.piecewise_step) in the last synchronised backward
        self.last_sliced_params = 0
        # seconds of write-back and update left after the last reduction arrived: what the overlap could not hide
        self.last_exposed_update_s = 0.0
        self._plan_key: tuple[Any, ...] | None = None
        self._bucket_groups: list[list[tuple[int, list[torch.nn.Parameter]]]] = []
        self._guard = optimizer.register_step_pre_hook(self._refuse_second_step)
        self._scaler_checked = False  # refuse_grad_scaler runs once, before the first overlapped step

    def close(self) -> None:
        """Stop guarding the optimizer's own ``step()`` (the overlap was removed or replaced)."""
        self._guard.remove()

    @property
    def stepped(self) -> bool:
        """Whether the last synchronised backward stepped the optimizer and no forward ran since."""
        return self.reducer.synced_since_forward

    def _refuse_second_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.stepped:
            raise RuntimeError(
                f"lightning_ddpx: {type(optimizer).__name__}.step() was called after a synchronised backward "
                "that already stepped it bucket by bucket (overlap_optimizer_with): a second step would apply "
                "the update twice. Remove the optimizer.step() call after backward (the Lightning strategies "
                "do this for you), or call model.overlap_optimizer_with(None) to step yourself. With a "
                "torch.amp.GradScaler (scaler.step(optimizer) calls step()): the overlap cannot scale "
                "gradients, and the update in backward used scaled gradients; use the plain step."
            )

    # ------------------------------------------------------------------------------------ the plan
    def _groups_per_bucket(self) -> list[list[tuple[int, list[torch.nn.Parameter]]]]:
        """For each bucket, (group index, the group's parameters in this bucket); cached per bucket plan
        and per parameter lists of the groups (``add_param_group`` changes them)."""
        groups = self.optimizer.param_groups
        # the objects themselves, compared by identity: a list freed by a rebuild could lend its id to a new one
        key = (self.reducer.layout, *(g["params"] for g in groups), *(len(g["params"]) for g in groups))
        if not _unchanged(key, self._plan_key):
            layout = self.reducer.layout
            bucket_of = {id(p): layout.bucket_of[i] for i, p in enumerate(self.reducer.params)}
            plan: list[list[tuple[int, list[torch.nn.Parameter]]]] = [[] for _ in self.reducer.buckets]
            for g, group in enumerate(groups):
                per_bucket: dict[int, list[torch.nn.Parameter]] = {}
                for p in group["params"]:
                    b = bucket_of.get(id(p))
                    if b is not None:
                        per_bucket.setdefault(b, []).append(p)
                for b, params in per_bucket.items():
                    plan[b].append((g, params))
            self._bucket_groups, self._plan_key = plan, key
        return self._bucket_groups

    def _view(self) -> torch.optim.Optimizer:
        return optimizer_view(self.optimizer)

    # --------------------------------------------------------------------------------- per bucket
    def write_back_and_step(self, results: ResultsInOrder) -> None:
        """The end of a synchronised backward with overlap: each bucket's parameters step as it arrives.

        torch's global optimizer step hooks fire once for the whole step, not once per bucket or slice.
        """
        if not self._scaler_checked:
            refuse_grad_scaler(self.optimizer)  # before any update: the gradients may be scaled
            self._scaler_checked = True
        with global_optimizer_hooks_once(self.optimizer):
            self._write_back_and_step(results)

    def _write_back_and_step(self, results: ResultsInOrder) -> None:
        reducer = self.reducer
        plan, view, groups = self._groups_per_bucket(), self._view(), self.optimizer.param_groups
        used, index_of = reducer.used.local, reducer.index_of  # per parameter index; parameter -> index

        def locally_used(param: torch.nn.Parameter) -> bool:
            return bool(used[index_of[id(param)]])

        stepping = 0.0
        deferred: list[tuple[int, torch.Tensor]] = []
        self.last_sliced_params = 0
        for b, result in results:
            if not results.counts_pending or reducer.bucket_all_used(b):
                reducer.write_back(b, result, results.known_counts)  # every parameter is used somewhere
                members = plan[b]
            else:  # only this rank's used parameters are known to be used somewhere
                reducer.write_back(b, result, used)
                members = _subset(plan[b], locally_used)
                deferred.append((b, result))
            stepping += self._step(view, groups, members)
        if results.counts_pending:
            counts = results.counts()
            assert counts is not None
            rest = [0 if used[i] else count for i, count in enumerate(counts)]
            for b, result in deferred:
                reducer.write_back(b, result, rest)
                stepping += self._step(view, groups, _subset(plan[b], lambda p: not locally_used(p)))
        self.last_optimizer_s = stepping
        self.last_exposed_update_s = time.perf_counter() - results.last_arrival
        mark_stepped_for_lr_scheduler(self.optimizer)  # step() was bypassed: its LR scheduler must not warn

    def _step(
        self, view: torch.optim.Optimizer, groups: list[dict[str, Any]], members: list[tuple[int, list[Any]]]
    ) -> float:
        """Step ``members`` (group index, parameters): parameters longer than a slice that qualify are
        updated slice by slice (cache-sized: faster, same values), the rest in one ``step()`` of ``view``."""
        if not members:
            return 0.0
        started = time.perf_counter()
        together: list[tuple[int, list[Any]]] = []
        for g, params in members:
            rest = [p for p in params if not self._stepped_in_slices(groups[g], p)]
            if rest:
                together.append((g, rest))
        if together:
            view.param_groups = [{**groups[g], "params": params} for g, params in together]
            with label("lightning_ddpx::overlap_optimizer_step"):
                view.step()
        return time.perf_counter() - started

    def _stepped_in_slices(self, group: dict[str, Any], param: torch.nn.Parameter) -> bool:
        """Update ``param`` slice by slice if it is long enough and qualifies; whether it was."""
        if self.slice_bytes is None:
            return False
        slice_numel = max(1, self.slice_bytes // param.dtype.itemsize)
        if param.numel() <= slice_numel:
            return False
        ranges = chunk_ranges([0], [param.numel()], slice_numel)  # cuts aligned: see bucketing
        if len(ranges) < 2 or not steps_in_pieces(self.optimizer, param):
            return False
        piecewise = PiecewiseStep(self._view, group, param, self.optimizer.state[param])
        with label("lightning_ddpx::overlap_optimizer_step_slices"):
            for start, end in ranges:
                piecewise.step(start, end)
            piecewise.finish()
        self.last_sliced_params += 1
        return True


def _subset(members: list[tuple[int, list[Any]]], keep: Any) -> list[tuple[int, list[Any]]]:
    kept = [(g, [p for p in params if keep(p)]) for g, params in members]
    return [(g, params) for g, params in kept if params]


def _unchanged(key: tuple[Any, ...], cached: tuple[Any, ...] | None) -> bool:
    """Lists by identity, lengths by value."""
    return (
        cached is not None
        and len(cached) == len(key)
        and all(a == b if isinstance(a, int) else a is b for a, b in zip(key, cached))
    )
