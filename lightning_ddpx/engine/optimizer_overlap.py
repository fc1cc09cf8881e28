"""The optimizer step overlapped with communication: each bucket's parameters step as soon as it is reduced.

Without overlap, the end of backward waits for every bucket, writes every averaged gradient, and only then
does ``optimizer.step()`` update all parameters. With :meth:`DistributedDataParallel.overlap_optimizer_with
<lightning_ddpx.engine.module.DistributedDataParallel.overlap_optimizer_with>`, the end of backward walks the
buckets in launch order: wait for bucket ``b``, write its gradients into ``param.grad``, step the optimizer for
its parameters -- while buckets ``b+1 ...`` are still being reduced on the communication threads. The update
of the early buckets then hides behind the communication of the late ones. The last bucket, with nothing
left to hide behind, is reduced in chunks on the CPU default path and updated chunk by chunk as they arrive
(:class:`_ChunkedBucket`), and parameters longer than the first bucket's cap are updated in cache-sized
slices (:mod:`lightning_ddpx.engine.piecewise_step`): same values, less exposed and faster.

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

from lightning_ddpx._compat.torch import foreach_copy_, global_optimizer_hooks_once
from lightning_ddpx.engine.bucketing import chunk_ranges
from lightning_ddpx.engine.errors import waiting_for
from lightning_ddpx.engine.piecewise_step import PiecewiseStep, optimizer_view, steps_in_pieces
from lightning_ddpx.engine.profiling import label

if TYPE_CHECKING:
    from lightning_ddpx.engine.reducer import Reducer

__all__ = ["OptimizerOverlap", "check_overlappable", "per_parameter_optimizers"]


def per_parameter_optimizers() -> tuple[type[torch.optim.Optimizer], ...]:
    """torch's optimizers whose update of a parameter depends on that parameter's gradient and state only."""
    names = ("SGD", "Adam", "AdamW", "Adamax", "Adadelta", "Adagrad", "Adafactor", "ASGD", "NAdam",
             "RAdam", "RMSprop", "Rprop")  # fmt: skip
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
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
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

    def __init__(self, optimizer: torch.optim.Optimizer, reducer: Reducer) -> None:
        check_overlappable(optimizer, reducer.params, reducer.names)
        self.optimizer = optimizer
        self.reducer = reducer
        self.last_optimizer_s = 0.0  # time spent in bucket steps in the last synchronised backward
        # parameters updated slice by slice (engine.piecewise_step) in the last synchronised backward
        self.last_sliced_params = 0
        # seconds of write-back and update left after the last reduction arrived: what the overlap could not hide
        self.last_exposed_update_s = 0.0
        self._last_arrival = 0.0
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
        return self.reducer._synced_since_forward

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
        key = (self.reducer.buckets, *(g["params"] for g in groups), *(len(g["params"]) for g in groups))
        if not _unchanged(key, self._plan_key):
            bucket_of = {id(p): self.reducer._bucket_of[i] for i, p in enumerate(self.reducer.params)}
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
    def write_back_and_step(self, globally_used: torch.futures.Future | None) -> float:
        """The end of a synchronised backward with overlap; returns the seconds spent waiting for results.

        ``globally_used``: the used-parameter bitmap's future when this iteration shares one (find_unused /
        static graph's first iteration), else ``None``. torch's global optimizer step hooks fire once for the
        whole step, not once per bucket or slice.
        """
        if not self._scaler_checked:
            refuse_grad_scaler(self.optimizer)  # before any update: the gradients may be scaled
            self._scaler_checked = True
        with global_optimizer_hooks_once(self.optimizer):
            return self._write_back_and_step(globally_used)

    def _write_back_and_step(self, globally_used: torch.futures.Future | None) -> float:
        reducer = self.reducer
        plan, view, groups = self._groups_per_bucket(), self._view(), self.optimizer.param_groups
        known_counts = reducer.static.globally_used if reducer.static is not None else None
        if globally_used is not None:
            known_counts = None
        locally_used, index_of = reducer._locally_used, reducer._index_of
        waited = stepping = 0.0
        deferred: list[tuple[int, torch.Tensor]] = []
        last = len(reducer.buckets) - 1
        self.last_sliced_params = 0
        for b in range(len(reducer.buckets)):
            if b == last and reducer.reduces_last_bucket_in_chunks and not reducer._unused_in_bucket[b]:
                chunk_waited, chunk_stepping = self._write_back_and_step_by_chunks(b, groups, plan[b])
                waited, stepping = waited + chunk_waited, stepping + chunk_stepping
                continue
            started = time.perf_counter()
            result = reducer._result_of(b)
            self._last_arrival = time.perf_counter()
            waited += self._last_arrival - started
            if globally_used is None or not reducer._unused_in_bucket[b]:
                with torch.no_grad():  # every parameter of the bucket is known to be used somewhere
                    reducer._write_back_bucket(b, result, known_counts)
                members = plan[b]
            else:  # only this rank's used parameters are known to be used somewhere
                with torch.no_grad():
                    reducer._write_back_bucket(b, result, locally_used)
                members = _subset(plan[b], lambda p: locally_used[index_of[id(p)]])
                deferred.append((b, result))
            stepping += self._step(view, groups, members)
        if globally_used is not None:
            started = time.perf_counter()
            with waiting_for("the used-parameter bitmap (find_unused_parameters)", reducer.process_group):
                counts = globally_used.wait()[0].tolist()
            self._last_arrival = time.perf_counter()
            waited += self._last_arrival - started
            if reducer.static is not None:
                reducer.static.record(counts)
            rest = [0 if locally_used[i] else count for i, count in enumerate(counts)]
            for b, result in deferred:
                with torch.no_grad():
                    reducer._write_back_bucket(b, result, rest)
                stepping += self._step(
                    view, groups, _subset(plan[b], lambda p: not locally_used[index_of[id(p)]])
                )
        self.last_optimizer_s = stepping
        self.last_exposed_update_s = time.perf_counter() - self._last_arrival
        if hasattr(self.optimizer.step, "_wrapped_by_lr_sched"):
            self.optimizer._opt_called = True  # type: ignore[attr-defined]  # an LR scheduler's "step ran" mark
        return waited

    def _write_back_and_step_by_chunks(
        self, b: int, groups: list[dict[str, Any]], members: list[tuple[int, list[torch.nn.Parameter]]]
    ) -> tuple[float, float]:
        """The last bucket, reduced in chunks (every parameter used on this rank): as each chunk arrives,
        write its gradients back and update what it completes (:class:`_ChunkedBucket`). Returns (seconds
        waited, seconds stepping)."""
        bucket = _ChunkedBucket(self, b, groups, members)
        waited = stepping = 0.0
        for start, end, waited_s in self.reducer.reduced_chunks_of_last():
            waited += waited_s
            started = self._last_arrival = time.perf_counter()
            whole = bucket.arrived(start, end)
            stepping += time.perf_counter() - started
            stepping += self._step(self._view(), groups, whole)
        self.last_sliced_params += bucket.sliced
        return waited, stepping

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
        slice_numel = self.reducer.slice_numel(param.dtype)
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


class _ChunkedBucket:
    """One synchronised backward's last bucket as its chunks arrive (``arrived``, in order): each chunk's
    gradients are written back; a parameter inside one chunk is returned to be stepped with the others;
    a parameter cut across chunks is updated slice by slice (:mod:`lightning_ddpx.engine.piecewise_step`)
    when it qualifies, else returned whole with the chunk that completes it."""

    def __init__(
        self,
        overlap: OptimizerOverlap,
        b: int,
        groups: list[dict[str, Any]],
        members: list[tuple[int, list[torch.nn.Parameter]]],
    ) -> None:
        self._overlap = overlap
        self._bucket = overlap.reducer.buckets[b]
        self._groups = groups
        self._group_of = {id(p): g for g, params in members for p in params}
        self._spans = [
            (offset, offset + p.numel()) for offset, p in zip(self._bucket.spec.offsets, self._bucket.params)
        ]
        self._write_back = not overlap.reducer.gradient_as_bucket_view
        self._pieces: dict[int, PiecewiseStep | None] = {}  # position in the bucket -> its piecewise update
        self._first = 0  # the first parameter (position) not yet complete
        self.sliced = 0  # parameters updated slice by slice

    @torch.no_grad()
    def arrived(self, start: int, end: int) -> list[tuple[int, list[torch.nn.Parameter]]]:
        """Elements ``start:end`` of the buffer are reduced: write them back, update the slices they
        complete; returns (group index, parameters) to step whole now."""
        whole: dict[int, list[torch.nn.Parameter]] = {}
        grads, views = [], []
        position = self._first
        while position < len(self._spans) and self._spans[position][0] < end:
            offset, stop = self._spans[position]
            param, view = self._bucket.params[position], self._bucket.views[position]
            lo, hi, complete = max(start, offset) - offset, min(end, stop) - offset, stop <= end
            g = self._group_of.get(id(param))
            if lo == 0 and complete:  # the whole parameter is in this chunk
                if self._write_back:
                    grads.append(param.grad)
                    views.append(view)
                if g is not None:
                    whole.setdefault(g, []).append(param)
            else:
                self._write_back_slice(param, view, lo, hi, complete)
                if g is not None and not self._step_slice(position, param, g, lo, hi, complete) and complete:
                    whole.setdefault(g, []).append(param)
            if not complete:
                break
            position += 1
        self._first = position
        if grads:
            foreach_copy_(grads, views)
        return sorted(whole.items())

    def _write_back_slice(
        self, param: torch.nn.Parameter, view: torch.Tensor, lo: int, hi: int, complete: bool
    ) -> None:
        grad = param.grad
        if not self._write_back or grad is None:
            return
        if grad.is_contiguous():
            grad.view(-1)[lo:hi].copy_(view.view(-1)[lo:hi])
        elif complete:
            grad.copy_(view)  # a strided gradient: written whole with its last slice

    def _step_slice(
        self, position: int, param: torch.nn.Parameter, g: int, lo: int, hi: int, complete: bool
    ) -> bool:
        """Update elements ``lo:hi`` of ``param`` if it qualifies (decided at its first slice); whether it did."""
        if position not in self._pieces:
            optimizer = self._overlap.optimizer
            grad = param.grad
            qualifies = grad is not None and grad.is_contiguous() and steps_in_pieces(optimizer, param)
            state = optimizer.state.get(param) if qualifies else None
            self._pieces[position] = (
                PiecewiseStep(self._overlap._view, self._groups[g], param, state) if state else None
            )
        piecewise = self._pieces[position]
        if piecewise is None:
            return False
        with label("lightning_ddpx::overlap_optimizer_step_slice"):
            piecewise.step(lo, hi)
        if complete:
            piecewise.finish()
            self.sliced += 1
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
