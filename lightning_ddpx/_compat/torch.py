"""Private torch names lightning_ddpx uses: why, and since which torch version (our floor is 2.6).

Plain aliases where the name is a callable we call on hot paths (no extra Python frame per call); small
functions where an attribute chain or a lazy import (``torch._dynamo`` costs a second to import) is involved.
One import-order rule, below the imports.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import _JoinConfig

# torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a default argument, evaluated
# when the module is first imported: imported while a default process group exists (torch._dynamo imports
# it, and torch.optim imports dynamo at an optimizer's first parameter group), it holds that group for the
# life of the process, and ``destroy_process_group()`` no longer closes its connections. Fault tolerance
# relies on that close: the peers blocked on a member whose step failed then fail at once instead of after
# the collective timeout. Imported here, before any group exists, its defaults hold ``None`` (3 ms).
import torch.distributed.nn.functional  # noqa: E402, F401  (isort: skip)

__all__ = [
    "AnyFuture",
    "eager_under_compile",
    "JoinConfig",
    "aot_compiles",
    "allow_non_fake_inputs",
    "cuda_current_stream_key",
    "cuda_stream_of_key",
    "ddp_optimizer_context",
    "default_store",
    "default_group",
    "device_index",
    "dynamic_of",
    "fake_mode_of_current_trace",
    "foreach_add_",
    "foreach_copy_",
    "foreach_sub_",
    "global_optimizer_hooks_once",
    "group_timeout",
    "has_step_hooks",
    "in_backward_optimizers",
    "innermost_backend",
    "inputs_to_device",
    "is_fake",
    "lookup_backend",
    "mark_stepped_for_lr_scheduler",
    "params_and_buffers_to_ignore",
    "process_group_store",
    "profiler_enabled",
    "queue_backward_callback",
    "rank_not_in_group",
    "set_params_and_buffers_to_ignore",
    "sparse_nnz_bytes",
    "tracing_context",
    "will_engine_execute_node",
    "without_step_hooks",
]

# ---------------------------------------------------------------------------------------------- futures
# The base class of every torch future: the ones collectives return (``work.get_future()``) are instances of
# the C++ class, not of its Python subclass ``torch.futures.Future``, so ``isinstance`` needs this one to
# tell a hook's future from anything else it might return. torch >= 1.6.
AnyFuture: type = torch._C.Future

# --------------------------------------------------------------------------------------------- autograd
# Run a callback when the current backward pass ends: how a reducer knows every gradient of this backward
# has been produced (torch's C++ reducer uses the same engine hook; FSDP calls it from Python). torch >= 1.0.
queue_backward_callback: Callable[[Callable[[], None]], None] = (
    torch.autograd.Variable._execution_engine.queue_callback
)

# During a backward: whether the running graph task will execute an autograd node. ``torch.autograd.grad``
# of some inputs runs only the nodes leading to them, never a parameter's gradient accumulator; torch's own
# ``register_multi_grad_hook`` asks the same question. torch >= 2.0.
will_engine_execute_node: Callable[[Any], bool] = torch._C._will_engine_execute_node

# Whether the autograd profiler is recording: record_function labels cost a few microseconds each, so we
# only create them while someone is looking. torch >= 1.0.
profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled

# Multi-tensor kernels: one call for a bucket's worth of tensors instead of one per tensor (torch.optim's
# foreach implementations use them). _foreach_add_/_sub_ torch >= 1.7, _foreach_copy_ torch >= 2.1.
foreach_copy_: Callable[..., Any] = torch._foreach_copy_
foreach_add_: Callable[..., Any] = torch._foreach_add_
foreach_sub_: Callable[..., Any] = torch._foreach_sub_


def eager_under_compile(function: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(function)``, applied at its first call once ``torch._dynamo`` is loaded.

    Decorating with ``torch.compiler.disable`` imports ``torch._dynamo``, over a second on a 2-core CPU, for
    every process that imports the module defining the function, even when nothing is compiled (a
    fault-tolerant run's replacement pays it before it can be healed). Nothing can trace the function before
    dynamo is loaded, so until then the plain function runs. Public ``torch.compiler.disable``; the check is
    on ``sys.modules``."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return function(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(function))
        return disabled[0](*args, **kwargs)

    return call


def sparse_nnz_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a sparse COO tensor's indices and values, also when it is not coalesced (the public
    ``indices()``/``values()`` refuse that; reducing an embedding's gradient does not coalesce it first).
    ``_indices``/``_values``: torch >= 0.4."""
    indices, values = tensor._indices(), tensor._values()
    return indices.numel() * indices.element_size() + values.numel() * values.element_size()


@contextlib.contextmanager
def global_optimizer_hooks_once(optimizer: Any) -> Iterator[None]:
    """Run torch's global optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` /
    ``_post_hook``: profilers, trackers) once for ``optimizer`` around the block -- pre hooks before it, post
    hooks after it if it succeeds -- and silence them for the ``step()`` calls inside (the overlap steps an
    optimizer in many pieces, each of which would fire them). The registries are private dicts. torch >= 2.0."""
    from torch.optim import optimizer as optim_module

    pre, post = optim_module._global_optimizer_pre_hooks, optim_module._global_optimizer_post_hooks
    for hook in list(pre.values()):
        hook(optimizer, (), {})
    saved_pre, saved_post = dict(pre), dict(post)
    pre.clear()
    post.clear()
    try:
        yield
    finally:
        pre.update(saved_pre)  # hooks registered inside the block are kept too
        post.update(saved_post)
    for hook in list(post.values()):
        hook(optimizer, (), {})


# ------------------------------------------------------------------------------------------- optimizers
# Attributes torch's optimizers and LR schedulers keep on the objects themselves, with no public getter. The
# optimizer overlap steps an optimizer bucket by bucket, so it must see and mimic what a step() would touch.
def has_step_hooks(optimizer: Any) -> bool:
    """Whether ``optimizer.register_step_pre_hook`` / ``register_step_post_hook`` gave ``optimizer`` hooks of
    its own (``_optimizer_step_pre_hooks`` / ``_post_hooks``). torch >= 2.0; checked on torch 2.13.0."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks)


def without_step_hooks(optimizer: Any) -> None:
    """Give ``optimizer`` (a view sharing another optimizer's ``__dict__``) empty step-hook registries of its
    own, so its ``step()`` runs none of the original's hooks. Checked on torch 2.13.0."""
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()


def mark_stepped_for_lr_scheduler(optimizer: Any) -> None:
    """Record that ``optimizer`` stepped, as the wrapper an LR scheduler puts on ``optimizer.step`` does
    (``_wrapped_by_lr_sched`` marks the wrapper, ``_opt_called`` the step): a step that bypassed the wrapper
    would otherwise make the scheduler warn that ``lr_scheduler.step()`` ran before ``optimizer.step()``.
    Checked on torch 2.13.0."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True


def in_backward_optimizers(param: torch.Tensor) -> list[Any]:
    """The optimizers ``torch.distributed.optim._apply_optimizer_in_backward`` gave ``param`` (it appends them
    to ``param._in_backward_optimizers``); empty if none. torch >= 2.0; checked on torch 2.13.0."""
    return getattr(param, "_in_backward_optimizers", None) or []


# ------------------------------------------------------------------------------------------ DDP's module
# torch's DDP reads its ignore list from an attribute of the wrapped module, set by
# ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``; ours honours the same attribute, so
# a module prepared for torch's DDP works with ours and the other way round.
def params_and_buffers_to_ignore(module: Any) -> set[str]:
    """The fully qualified names torch's DDP would neither check, broadcast nor reduce for ``module``
    (``module._ddp_params_and_buffers_to_ignore``; empty if unset). torch >= 1.8; checked on 2.13.0."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def set_params_and_buffers_to_ignore(module: Any, names: Iterable[str]) -> None:
    """Set the list :func:`params_and_buffers_to_ignore` reads, where torch's DDP reads it. Checked on torch
    2.13.0."""
    module._ddp_params_and_buffers_to_ignore = names


# ------------------------------------------------------------------------------------------------- c10d
# torch's Join context manager reads ``module._join_config``; a Joinable built outside torch's DDP must set
# the disabled config itself, as torch's DDP does. torch >= 1.10.
JoinConfig = _JoinConfig

# Whether this rank is outside ``group`` (the model averagers skip groups they are not in). torch >= 1.8.
rank_not_in_group: Callable[[Any], bool] = dist._rank_not_in_group


def process_group_store(group: Any) -> Any:
    """The TCPStore a process group was created with (the hang diagnosis writes progress there). torch >= 2.0."""
    return dist.distributed_c10d._get_process_group_store(group)


def default_store() -> Any:
    """The default group's store, for groups created before the store was recorded. torch >= 2.0."""
    return dist.distributed_c10d._get_default_store()


def default_group() -> Any:
    """The default process group itself (``dist.group.WORLD`` is a placeholder object on some versions):
    what pickling compares a module's group with, as torch's DDP does. Raises before init. torch >= 1.8."""
    return dist.distributed_c10d._get_default_group()


def group_timeout(group: Any) -> Any:
    """The timeout a process group was created with (error messages say how long a peer was waited for):
    no public getter exists. torch >= 2.0 (``_get_backend``)."""
    return group._get_backend(torch.device("cpu")).options._timeout


# ----------------------------------------------------------------------------------------- devices
def cuda_current_stream_key(device_index: int) -> tuple[int, int, int]:
    """The current CUDA stream of a device as torch's own triple (stream id, device index, device type), the
    data ``torch.cuda.current_stream`` builds its ``Stream`` object from. The reducer notes it per gradient,
    where building the object (device-index parsing, a Python ``__new__``) cost several microseconds per call
    on a launch-bound GPU step. Equal triples are the same stream. torch >= 1.9; CUDA builds only (called
    only for CUDA tensors, whose gradients mean CUDA is initialised)."""
    return torch._C._cuda_getCurrentStream(device_index)


def cuda_stream_of_key(key: tuple[int, int, int]) -> "torch.cuda.Stream":
    """The ``torch.cuda.Stream`` of a triple from :data:`cuda_current_stream_key` (public constructor)."""
    return torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])


def device_index(device: Any) -> int:
    """An entry of ``device_ids`` (int, ``torch.device`` or string) as a device index, exactly as torch's DDP
    reads it (a device without an index means the current one). torch >= 1.0."""
    from torch._utils import _get_device_index

    return _get_device_index(device, True)


def inputs_to_device(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device, side_stream: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """forward's inputs moved to ``device`` as torch's DDP moves them with ``device_ids`` (tensors inside
    lists, dicts, namedtuples, dataclasses and PackedSequences; copies on a side stream). torch >= 2.0."""
    from torch.distributed.utils import _to_kwargs

    if not args and not kwargs:
        return args, kwargs  # torch indexes an empty result here; nothing to move
    moved_args, moved_kwargs = _to_kwargs(args, kwargs, device, side_stream)
    return moved_args[0], moved_kwargs[0]


# --------------------------------------------------------------------------------------- dynamo (compile)
def innermost_backend(callback: Any) -> Any:
    """The user's backend inside dynamo's wrappers of a ``torch.compile`` context. torch >= 2.1."""
    from torch._dynamo.eval_frame import innermost_backend as innermost

    return innermost(callback)


def lookup_backend(name: str) -> Any:
    """A dynamo backend by name (``torch.compile(backend="inductor")`` resolves names the same way). torch >= 2.0."""
    from torch._dynamo.backends.registry import lookup_backend as lookup

    return lookup(name)


def dynamic_of(dynamo_ctx: Any) -> Any:
    """The ``dynamic=`` a ``torch.compile`` call was given, read off its context (``None``: not given)."""
    return getattr(dynamo_ctx, "_dynamic", None)


def tracing_context() -> Any:
    """Dynamo's current TracingContext, or ``None`` outside a trace. torch >= 2.1."""
    from torch._guards import TracingContext

    return TracingContext.try_get()


def fake_mode_of_current_trace() -> Any:
    """The fake-tensor mode of the current trace, or a new one: pieces of a split graph are compiled with
    fake inputs, as dynamo compiles a whole graph. torch >= 2.1."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode() or FakeTensorMode()


def is_fake(value: Any) -> bool:
    from torch._subclasses import FakeTensor

    return isinstance(value, FakeTensor)


def ddp_optimizer_context() -> Any:
    """torch's protocol for several AOT graphs under one dynamo graph (torch's DDPOptimizer splits graphs
    the same way): each lazily compiled backward finds its own piece's forward metadata. torch >= 2.1."""
    from torch._dynamo.backends.distributed import DDPOptimizerContext

    return DDPOptimizerContext()


def aot_compiles() -> int:
    """How many graphs AOTAutograd has compiled so far in this process (dynamo's own counter). torch >= 2.0."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["total"]


@contextlib.contextmanager
def allow_non_fake_inputs(fake_mode: Any) -> Iterator[None]:
    """Let ``fake_mode`` accept real tensors (a compiled piece's parameters) while it runs on fakes; restored
    on exit. The flag is a constructor argument of FakeTensorMode that dynamo's own mode is built without."""
    previous = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        fake_mode.allow_non_fake_inputs = previous
