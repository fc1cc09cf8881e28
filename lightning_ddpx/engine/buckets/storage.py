"""Bucket storage: the flat gradient buffers, the views into them, and the copies in and out.

Pure tensor code, no process group: each function takes a :class:`Bucket` and the facts of this backward it
needs (which parameters were used, the scale), so the copies are tested in one process
(``tests/engine/test_buckets.py``). The reducer decides *when* these run; this module decides *how* the
gradients get into a bucket and back into ``param.grad``.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, TypeVar

import torch

from lightning_ddpx._compat.torch import foreach_copy_
from lightning_ddpx.engine.buckets.plan import BucketInfo, BucketSpec
from lightning_ddpx.engine.buckets.sparse import empty_sparse_like

__all__ = ["Bucket", "BucketLayout", "dense_without_overlap", "hook_views", "param_views"]

# With no hook, scaling happens during the copy into the bucket (one pass over the gradients instead of a copy
# and a multiply, as torch's reducer does). Per-parameter fused multiplies cost one dispatch each, so buckets
# of many small tensors copy in one batched call and scale the whole buffer instead.
_FUSED_SCALE_MIN_AVERAGE_NUMEL = 16384

F = TypeVar("F", bound=Callable)


def _without_grad(method: F) -> F:
    """``torch.no_grad()`` around ``method``, entered only when grad mode is on. The reducer calls these
    methods inside backward, where grad mode is already off unless ``create_graph=True``, and entering
    ``no_grad`` there costs a few microseconds per bucket (its decorator builds and enters a context object)."""
    grad_enabled = torch.is_grad_enabled

    @functools.wraps(method)
    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not grad_enabled():
            return method(*args, **kwargs)
        with torch.no_grad():
            return method(*args, **kwargs)

    return run  # type: ignore[return-value]


def param_views(
    flat: torch.Tensor, spec: BucketSpec, params: Sequence[torch.nn.Parameter]
) -> list[torch.Tensor]:
    """Views into ``flat`` (laid out like bucket ``spec``), one per parameter, shaped like it and, as in torch's
    reducer, strided like it when its elements are dense without overlap (a channels_last or transposed
    weight): the bucket then holds each gradient's bytes in the parameter's memory order, as torch's does,
    so a hook that reads them per parameter (PowerSGD) sees what it sees under torch's DDP."""
    views = []
    for offset, p in zip(spec.offsets, params):
        if p.is_contiguous() or not dense_without_overlap(p):
            views.append(flat[offset : offset + p.numel()].view_as(p))
        else:
            views.append(flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset))
    return views


def hook_views(
    flat: torch.Tensor, spec: BucketSpec, params: Sequence[torch.nn.Parameter]
) -> list[torch.Tensor]:
    """What ``GradBucket.gradients()`` holds, as in torch: each parameter's slice of ``flat`` viewed in its
    shape, in row-major order whatever the parameter's strides."""
    return [flat[offset : offset + p.numel()].view(p.shape) for offset, p in zip(spec.offsets, params)]


def dense_without_overlap(tensor: torch.Tensor) -> bool:
    """torch's ``is_non_overlapping_and_dense`` (not exposed in Python): the elements fill ``numel()``
    consecutive places in some order of the dimensions."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(tensor.stride(), tensor.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class Bucket:
    """Runtime storage for one :class:`BucketSpec`: the flat buffer and per-parameter views into it."""

    __slots__ = (
        "spec",
        "buffer",
        "views",
        "params",
        "nbytes",
        "names",
        "fused_scale",
        "strided",
        "hook_gradients",
        "real",
    )

    def __init__(self, spec: BucketSpec, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        self.spec = spec
        self.names = tuple(names[i] for i in spec.param_indices)
        self.params = [params[i] for i in spec.param_indices]
        # A sparse gradient is reduced as it is (lightning_ddpx.engine.buckets.sparse): no flat buffer, no views.
        self.buffer = torch.zeros(0 if spec.sparse else spec.numel, dtype=spec.dtype, device=spec.device)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.views = [] if spec.sparse else param_views(self.buffer, spec, self.params)
        # a parameter stored with other strides: hooks see the buffer through other views (hook_views)
        self.strided = not spec.sparse and any(not p.is_contiguous() for p in self.params)
        self.hook_gradients = hook_views(self.buffer, spec, self.params) if self.strided else self.views
        # Multiplying by 1.0 leaves a real number as it is; complex multiplication does not (an infinite part
        # times 1 + 0i gives a NaN), so only a real bucket may skip it (:meth:`scale_to_apply`).
        self.real = not spec.dtype.is_complex
        # Large gradients on average: scale while copying, one fused multiply per parameter (see above). Not on
        # CUDA: there each multiply is a kernel launch, several microseconds of host time that a launch-bound
        # step pays in full, while the buffer's second pass costs the GPU about 12 us per 25 MB at HBM speed.
        large = spec.numel >= _FUSED_SCALE_MIN_AVERAGE_NUMEL * len(self.params)
        self.fused_scale = large and spec.device.type != "cuda"

    def gradients_for_hook(self, buffer: torch.Tensor, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """``GradBucket.gradients()`` for ``buffer`` (laid out like this bucket; ``views``: its views); for
        the bucket's own buffer, made once with the bucket."""
        if buffer is self.buffer:
            return self.hook_gradients
        return hook_views(buffer, self.spec, self.params) if self.strided else views

    def scale_to_apply(self, scale: float | None) -> float | None:
        """``scale``, or ``None`` where multiplying by it changes nothing: 1.0 (the average over one rank) on
        a real bucket. torch's reducer multiplies by 1.0 there too; the result is the same, bit for bit."""
        return None if scale == 1.0 and self.real else scale

    def short_names(self) -> list[str]:
        """The parameter names, the first six, for messages."""
        names = list(self.names)
        return names if len(names) <= 6 else names[:6] + [f"... {len(names) - 6} more"]

    # ------------------------------------------------------------------------------------- filling
    @_without_grad
    def fill(
        self,
        scale: float | None,
        all_used: bool,
        target: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> None:
        """Fill the buffer (or ``target``: a flat buffer laid out like it, and its views) from ``param.grad``
        (zero for parameters holding none), times ``scale`` if given. ``all_used``: every parameter of the
        bucket produced a gradient in this backward (one batched copy then, unless a hook of the user's set
        a ``grad`` to ``None`` after it was accumulated: that parameter contributes zero, as in torch)."""
        buffer, views = target if target is not None else (self.buffer, self.views)
        try:
            if all_used and not (scale is not None and self.fused_scale):
                if _copied_all(views, [p.grad for p in self.params]):
                    if scale is not None:
                        buffer.mul_(scale)
                    return
            for param, view in zip(self.params, views):
                if param.grad is None:
                    view.zero_()
                elif scale is None:
                    view.copy_(param.grad)
                else:
                    torch.mul(param.grad, scale, out=view)
        except RuntimeError:
            self.refuse_unexpected_sparse()
            raise

    @_without_grad
    def adopt_grads_as_views(self, used: bytearray | None) -> None:
        """gradient_as_bucket_view: make each used parameter's ``grad`` its view, copying the values of
        gradients autograd allocated itself (after ``zero_grad(set_to_none=True)``) in one batched copy.
        ``used``: the parameters' used map when some were unused (their views were detached already)."""
        params, views = self.params, self.views
        grads = [param.grad for param in params]
        if used is not None:
            indices = self.spec.param_indices
            stale = [k for k, grad in enumerate(grads) if grad is not views[k] and used[indices[k]]]
        else:
            stale = [k for k, grad in enumerate(grads) if grad is not views[k]]
        if not stale:
            return  # gradients kept between steps (zero_grad(set_to_none=False)) were accumulated in place
        if len(stale) < len(grads):
            params, views, grads = ([items[k] for k in stale] for items in (params, views, grads))
        try:
            if not _copied_all(views, grads):  # a grad set to None by a hook of the user's contributes zero
                for view, grad in zip(views, grads):
                    view.zero_() if grad is None else view.copy_(grad)
        except RuntimeError:
            self.refuse_unexpected_sparse()
            raise
        for param, view in zip(params, views):
            param.grad = view

    @_without_grad
    def detach_unused_view(self, position: int) -> None:
        """A parameter this backward did not reach contributes the gradient it holds (accumulated in
        ``no_sync()`` micro-batches, or kept from earlier steps), or zero if it holds none, as in torch.
        Its own ``grad`` becomes a private copy until the end of backward, so that it keeps its value if
        no rank used the parameter (see :meth:`write_back`)."""
        param, view = self.params[position], self.views[position]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad is view:
            param.grad = view.clone()
        else:
            view.copy_(grad)

    def sparse_contribution(self, locally_used: bool, divisor: int | None) -> torch.Tensor:
        """What this rank hands the hook for a sparse bucket: the gradient itself, as torch does (divided by
        ``divisor`` on the default path, into a new tensor), an empty one if it holds none, or a copy if it
        was kept from earlier steps (so that it stays untouched if no rank used the parameter)."""
        param = self.params[0]
        grad = param.grad
        if grad is None:
            contribution = empty_sparse_like(param)
        elif not grad.is_sparse:
            raise RuntimeError(
                f"lightning_ddpx: parameter {self.names[0]!r} belongs to an embedding built with "
                f"sparse=True, so it was given a sparse bucket, but its gradient is {grad.layout}. Set the "
                "layer's sparse flag before wrapping the module and leave it unchanged afterwards."
            )
        else:
            contribution = grad if locally_used else grad.clone()
        return contribution if divisor is None else contribution.div(divisor)

    def refuse_unexpected_sparse(self) -> None:
        """A copy into a dense bucket failed: name the parameters whose gradient is sparse, if any."""
        sparse = [name for name, p in zip(self.names, self.params) if p.grad is not None and p.grad.is_sparse]
        if sparse:
            raise RuntimeError(
                f"lightning_ddpx: parameter(s) {sparse} received sparse gradients, but only the weights of "
                "nn.Embedding / nn.EmbeddingBag layers built with sparse=True are expected to (torch's rule), "
                "so they were planned into a dense bucket. Use such a layer for them, or compute a dense "
                "gradient (e.g. F.embedding(..., sparse=False))."
            )

    # ---------------------------------------------------------------------------------- write-back
    @_without_grad
    def write_back(
        self, result: torch.Tensor, used_counts: Sequence[int] | None, all_used: bool, as_view: bool
    ) -> None:
        """Put the reduced ``result`` into ``param.grad``.

        Parameters unused on every rank (``used_counts``) keep their ``grad``. With bucket views
        (``as_view``) the gradients already alias the buffer, so only the buffer is written.
        """
        if self.spec.sparse:  # the reduced sparse tensor becomes the gradient, unless no rank used it
            if used_counts is None or used_counts[self.spec.param_indices[0]]:
                self.params[0].grad = result
            return
        if result is not self.buffer:
            self.buffer.copy_(result)
        if all_used:
            # Every gradient of the bucket arrived on this rank, so each is used, and with bucket views each
            # ``grad`` was made its view at launch: one batched copy, or nothing (unless a hook of the user's
            # set a ``grad`` to ``None``: it gets a copy of the average, as in torch).
            if as_view or _copied_all([param.grad for param in self.params], self.views):
                return
            used_counts = None
        grads, views = [], []
        for index, param, view in zip(self.spec.param_indices, self.params, self.views):
            if used_counts is not None and used_counts[index] == 0:
                continue  # unused on every rank: leave its grad untouched
            if as_view:
                param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                grads.append(param.grad)
                views.append(view)
        if grads:
            foreach_copy_(grads, views)


def _copied_all(targets: list[torch.Tensor | None], sources: list[torch.Tensor | None]) -> bool:
    """One batched copy of ``sources`` into ``targets``; ``False``, having copied nothing, if a gradient
    among them is ``None`` (the batched copy checks every argument before copying any)."""
    try:
        foreach_copy_(targets, sources)
    except TypeError:
        if any(tensor is None for tensor in (*targets, *sources)):
            return False
        raise
    return True


class BucketLayout:
    """The buckets of one plan, and where each parameter sits in them (bucket index, position)."""

    def __init__(
        self, specs: Sequence[BucketSpec], params: Sequence[torch.nn.Parameter], names: Sequence[str]
    ) -> None:
        self.buckets = [Bucket(spec, params, names) for spec in specs]
        self.bucket_of = [0] * len(params)
        self.position_of = [0] * len(params)
        for b, bucket in enumerate(self.buckets):
            for position, index in enumerate(bucket.spec.param_indices):
                self.bucket_of[index] = b
                self.position_of[index] = position

    def parameter_order(self) -> list[int]:
        """Parameter indices in buffer order, bucket after bucket."""
        return [i for bucket in self.buckets for i in bucket.spec.param_indices]

    def infos(self) -> list[BucketInfo]:
        return [
            BucketInfo(b, bucket.spec.num_bytes, bucket.spec.dtype, bucket.spec.device, bucket.names)
            for b, bucket in enumerate(self.buckets)
        ]

    @_without_grad
    def alias_grads(self) -> None:
        """Make every existing ``param.grad`` a view into its bucket (values kept)."""
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not None and param.grad is not view:
                    view.copy_(param.grad)
                    param.grad = view
