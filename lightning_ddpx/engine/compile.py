"""torch.compile for a model in our ``DistributedDataParallel``, split so communication overlaps backward.

Why split: AOTAutograd turns a compiled graph's whole backward into one autograd node, so every gradient
becomes ready at once, after all of backward, and no bucket can be reduced while backward still computes
(torch's ``DDPOptimizer`` exists for this reason, for torch's DDP). :func:`compile_model` hands dynamo a
backend that cuts each captured graph where our bucket plan's buckets become complete: the backward of the
last piece produces bucket 0's gradients, whose reduction then overlaps the backward of the pieces before it.

Why compile only after the bucket rebuild: the reducer launches buckets strictly in order and re-plans them
from the gradient order it observes in the first synchronised backward. Observed under a compiled whole
graph, that order says nothing about the model; observed eagerly it is the true reverse-forward order, which
is what the split follows. So the module runs eagerly until its layout is final (two steps with a fresh
module, none after a checkpoint's layout is loaded), then compiles; a later change of plan recompiles.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from lightning_ddpx._compat import torch as torch_compat
from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel

__all__ = ["GraphSplit", "PlanAwareCompiled", "compile_model", "compiled_graphs"]

log = logging.getLogger(__name__)

Backend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


@dataclass(frozen=True)
class GraphSplit:
    """How one graph captured by dynamo was compiled: one entry per piece, in forward order.

    ``buckets[i]`` are the bucket indices (launch order) whose last gradient piece ``i``'s backward produces;
    ``len(buckets) == 1`` means the graph was compiled whole.
    """

    buckets: tuple[tuple[int, ...], ...]

    @property
    def pieces(self) -> int:
        return len(self.buckets)


# ----------------------------------------------------------------------------------------- public API
def compile_model(
    ddp_model: DistributedDataParallel,
    backend: str | Backend = "inductor",
    split: bool = True,
    **compile_kwargs: Any,
) -> DistributedDataParallel:
    """Compile the module inside ``ddp_model`` in place and return ``ddp_model``.

    Args:
        ddp_model: our ``DistributedDataParallel``; its wrapped module's ``forward`` is replaced.
        backend: the compiler for each piece: ``"inductor"``, ``"aot_eager"``, any dynamo backend name or a
            backend callable ``(graph_module, example_inputs) -> callable``.
        split: cut each captured graph at bucket boundaries (overlap); ``False`` compiles graphs whole.
        compile_kwargs: passed to ``torch.compile`` (``dynamic``, ``fullgraph``, ``mode``, ``options``).

    The wrapper's own bookkeeping always runs eagerly. Until the bucket layout is final the module runs
    eagerly (see the module docstring); :func:`compiled_graphs` tells what was compiled.

    Example::

        >>> import lightning_ddpx
        >>> model = lightning_ddpx.DistributedDataParallel(net)  # doctest: +SKIP
        >>> model = lightning_ddpx.compile_model(model, backend="inductor")  # doctest: +SKIP
        >>> loss_fn(model(x), y).backward()  # doctest: +SKIP
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            "lightning_ddpx.compile_model expects a lightning_ddpx.DistributedDataParallel, got "
            f"{type(ddp_model).__name__}. Wrap the model first, then compile: compile_model(DistributedDataParallel(model))."
        )
    if "backend" in compile_kwargs:
        raise TypeError(
            "lightning_ddpx.compile_model: pass the backend as backend=..., not in compile_kwargs"
        )
    module = ddp_model.module
    original = _unwrap(module.forward)
    module.forward = PlanAwareCompiled(original, ddp_model, backend, split, compile_kwargs)  # type: ignore[method-assign]
    return ddp_model


def compiled_graphs(ddp_model: DistributedDataParallel) -> list[GraphSplit]:
    """Every graph compiled so far for ``ddp_model`` (by :func:`compile_model` or the Lightning strategy)."""
    module = ddp_model.module
    for name in ("forward", "training_step"):
        compiled = getattr(module, name, None)
        if isinstance(compiled, PlanAwareCompiled):
            return list(compiled.graphs)
    return []


def _unwrap(method: Callable[..., Any]) -> Callable[..., Any]:
    """A second compile_model replaces the first instead of stacking."""
    return method.original if isinstance(method, PlanAwareCompiled) else method


# ------------------------------------------------------------------------------------- the dispatcher
class PlanAwareCompiled:
    """Stands in for a module method: eager until the bucket layout is final, then compiled for that plan."""

    def __init__(
        self,
        original: Callable[..., Any],
        ddp_model: DistributedDataParallel,
        backend: str | Backend,
        split: bool,
        compile_kwargs: dict[str, Any],
    ) -> None:
        self.original = original
        self.__wrapped__ = original  # what signature checks and Lightning's is_overridden look at
        self._ddp = weakref.ref(ddp_model)  # the module must not keep a closed wrapper alive
        self.backend = backend
        self.split = split
        self.compile_kwargs = compile_kwargs
        self.graphs: list[GraphSplit] = []
        self._compiled: Callable[..., Any] | None = None
        self._plan_key: tuple[tuple[str, ...], ...] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ddp_model = self._ddp()
        if ddp_model is None:  # the wrapper is gone (e.g. after Trainer.fit): plain compiled call
            return self._compile_plain()(*args, **kwargs)
        if not ddp_model.reducer.planner.settled:  # compiled along the final bucket layout only
            with torch.compiler.set_stance("force_eager"):
                return self.original(*args, **kwargs)
        key = tuple(info.parameter_names for info in ddp_model.bucket_plan())
        if key != self._plan_key:
            self._compiled = torch.compile(
                self.original, backend=self._backend_for(ddp_model), **self.compile_kwargs
            )
            self._plan_key = key
        assert self._compiled is not None
        return self._compiled(*args, **kwargs)

    def _backend_for(self, ddp_model: DistributedDataParallel) -> Backend:
        inner = _resolve_backend(self.backend)
        if not self.split:
            return _Recording(inner, self.graphs)
        return BucketSplitBackend(ddp_model, inner, self.graphs)

    def _compile_plain(self) -> Callable[..., Any]:
        if self._plan_key is not None or self._compiled is None:
            self._compiled = torch.compile(self.original, backend=self.backend, **self.compile_kwargs)
            self._plan_key = None
        return self._compiled


def _resolve_backend(backend: str | Backend) -> Backend:
    if isinstance(backend, str):
        try:
            return torch_compat.lookup_backend(backend)
        except Exception as error:  # noqa: BLE001 - torch raises its own InvalidBackend
            raise ValueError(
                f"lightning_ddpx.compile_model: unknown backend {backend!r} ({error}); use 'inductor', "
                "'aot_eager' or a name from torch._dynamo.list_backends()."
            ) from None
    if not callable(backend):
        raise TypeError(
            f"lightning_ddpx.compile_model: backend must be a name or a callable, got {backend!r}"
        )
    return backend


class _Recording:
    """The inner backend, compiling graphs whole, noting each one in ``graphs`` (split=False)."""

    def __init__(self, inner: Backend, graphs: list[GraphSplit]) -> None:
        self.inner, self.graphs = inner, graphs

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append(GraphSplit(((),)))
        return self.inner(gm, example_inputs)


# ------------------------------------------------------------------------------------ the split backend
class BucketSplitBackend:
    """A dynamo backend: cut the graph where buckets complete, compile each piece with ``inner``."""

    def __init__(self, ddp_model: DistributedDataParallel, inner: Backend, graphs: list[GraphSplit]) -> None:
        self.inner = inner
        self.graphs = graphs
        params = dict(ddp_model.module.named_parameters())
        self.bucket_of = {
            id(params[name]): info.index for info in ddp_model.bucket_plan() for name in info.parameter_names
        }

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        param_nodes = _parameter_nodes(gm, example_inputs, self.bucket_of)
        pieces, buckets = assign_pieces(gm, param_nodes)
        if len(buckets) <= 1:
            self.graphs.append(GraphSplit(tuple(buckets) or ((),)))
            return self.inner(gm, example_inputs)
        try:
            compiled = _compile_pieces(gm, pieces, example_inputs, self.inner)
        except Exception as error:  # noqa: BLE001 - correctness first: the whole graph still compiles
            warnings.warn(
                f"lightning_ddpx: splitting a compiled graph at bucket boundaries failed ({error!r}); this "
                "graph is compiled whole, so its gradients are reduced only after its backward.",
                stacklevel=2,
            )
            self.graphs.append(GraphSplit(((),)))
            return self.inner(gm, example_inputs)
        self.graphs.append(GraphSplit(tuple(buckets)))
        return compiled


def _parameter_nodes(
    gm: fx.GraphModule, example_inputs: Sequence[Any], bucket_of: dict[int, int]
) -> dict[fx.Node, int]:
    """Graph nodes that are our parameters (placeholders, or ``get_attr`` without inlined modules) -> bucket."""
    found: dict[fx.Node, int] = {}
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if id(value) in bucket_of:
            found[node] = bucket_of[id(value)]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if id(value) in bucket_of:
                found[node] = bucket_of[id(value)]
    return found


def assign_pieces(
    gm: fx.GraphModule, param_nodes: dict[fx.Node, int]
) -> tuple[dict[fx.Node, int], list[tuple[int, ...]]]:
    """Map every computing node to a piece (0 = first in forward) and list the buckets each piece completes.

    Walking the graph backwards is walking backward's order. A parameter's gradient is complete once all
    its uses were walked; a cut goes right after the node that completes the next bucket(s) in launch
    order, counting only the parameters this graph uses. Nodes before the last cut that use no parameter
    join the piece after them (a piece with no gradients would only add a boundary).
    """
    uses_left = {node: len(node.users) for node in param_nodes}
    remaining: dict[int, int] = {}
    for bucket in param_nodes.values():
        remaining[bucket] = remaining.get(bucket, 0) + 1
    order = sorted(remaining)  # buckets of this graph in launch order
    done = 0  # leading entries of `order` complete so far
    from_end: dict[fx.Node, int] = {}
    completed: list[tuple[int, ...]] = []
    piece = 0
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output") or node in param_nodes:
            continue
        from_end[node] = piece
        for arg in set(node.all_input_nodes):
            if arg in uses_left:
                uses_left[arg] -= 1
                if uses_left[arg] == 0:
                    remaining[param_nodes[arg]] -= 1
        start = done
        while done < len(order) and remaining[order[done]] == 0:
            done += 1
        if done > start:
            completed.append(tuple(order[start:done]))
            piece += 1
    if piece == 0:
        return {node: 0 for node in from_end}, completed
    last = piece - 1  # nodes after the final completion (walking backwards) use no parameter: merge them
    pieces = {node: last - min(p, last) for node, p in from_end.items()}
    for node in param_nodes:
        if node.op == "get_attr":  # copied into the first piece that uses it
            users = [pieces[user] for user in node.users if user in pieces]
            pieces[node] = min(users) if users else 0
    return pieces, list(reversed(completed))


def _compile_pieces(
    gm: fx.GraphModule, pieces: dict[fx.Node, int], example_inputs: list[Any], inner: Backend
) -> fx.GraphModule:
    """Split ``gm`` along ``pieces`` and replace each piece by its compiled form, in forward order."""
    split = split_module(gm, None, lambda node: pieces[node], keep_original_order=True, tuple_return=True)
    fake_inputs = [_fake_example(node, value) for node, value in zip(_placeholders(gm), example_inputs)]
    _PieceCompiler(split, inner).run(*fake_inputs)
    split.recompile()
    return split


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if node.op == "placeholder"]


def _fake_example(node: fx.Node, value: Any) -> Any:
    """Dynamo's fake value for a graph input (symbolic shapes included), else the value itself."""
    return node.meta.get("example_value", value)


class _PieceCompiler(fx.Interpreter):
    """Runs the split graph on fake values; on reaching a piece, compiles it and computes its fake outputs.

    Each piece is compiled with fake inputs from dynamo's fake mode, like dynamo compiles a whole graph.
    Its outputs (the next pieces' inputs) come from the compiled piece itself when AOTAutograd compiled it
    (first call returns fakes, with the strides the compiled code will really produce), otherwise from
    running the piece on fakes. Each piece's AOT metadata is kept for its lazily compiled backward.
    """

    def __init__(self, module: fx.GraphModule, inner: Backend) -> None:
        super().__init__(module)
        self.inner = inner
        self.context = torch_compat.tracing_context()
        self.fake_mode = torch_compat.fake_mode_of_current_trace()
        if self.context is not None:
            # Torch's protocol for N AOT graphs under one dynamo graph: each lazily compiled backward finds
            # the forward metadata of its own piece (see torch's Note [DDPOptimizer and fw_metadata]).
            self.context.ddp_optimizer_ctx = torch_compat.ddp_optimizer_context()

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        assert not kwargs, "split_module pieces take positional arguments only"
        piece = self.fetch_attr(str(target))
        args = tuple(self._fake(a) for a in args)
        aot_before = torch_compat.aot_compiles()
        if self.context is not None:
            self.context.fakify_first_call = True
        try:
            compiled = self.inner(piece, list(args))
            with self.fake_mode, torch_compat.allow_non_fake_inputs(self.fake_mode):
                if self.context is not None and torch_compat.aot_compiles() != aot_before:
                    ddp_ctx = self.context.ddp_optimizer_ctx
                    ddp_ctx.curr_bucket += 1
                    ddp_ctx.metadata_per_bucket.append(self.context.fw_metadata)
                    outputs = compiled(*args)
                else:
                    outputs = piece(*args)
        finally:
            if self.context is not None:
                self.context.fakify_first_call = False
        self.module.delete_submodule(str(target))
        self.module.add_submodule(str(target), _Piece(compiled))
        return outputs

    def _fake(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not torch_compat.is_fake(value):
            return self.fake_mode.from_tensor(value)
        return value


class _Piece(nn.Module):
    """A compiled piece as a submodule of the split graph (``tuple_return``: its output is a tuple)."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any) -> Any:
        return self.compiled(*args)
