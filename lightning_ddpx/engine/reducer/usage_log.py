"""torch's DDP usage-logger surface (``_get_ddp_logging_data()``), filled with what this module knows truthfully.

torch's DDP keeps a C++ logger: construction settings, a few sampled runtime figures and the last error DDP
raised. Code and tests read it through ``_get_ddp_logging_data()`` (e.g. torch's ``verify_ddp_error_logged``).
We give the same keys, value types and formatting for what we know exactly; torch's timing keys are left out
(our reducer does not time forward and backward the C++ way: ``comm_stats()`` reports what it measures).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddpx.engine.buckets.plan import megabytes_to_bytes
from lightning_ddpx.engine.option_values import check_int
from lightning_ddpx.engine.transport.transports import hook_name

if TYPE_CHECKING:
    from lightning_ddpx.engine.buckets.plan import BucketInfo

# torch's sampling: runtime state recorded at the first 10 iterations, then every ``sample_rate``-th
_ALWAYS_SAMPLED = 10
_DEFAULT_SAMPLE_RATE = 100
# torch reads these environment variables into the logger ("N/A" when unset)
_ENV_KEYS = {
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
    "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
}
_GLOO_ENV_KEYS = {
    "gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
    "gloo_device_transport": "GLOO_DEVICE_TRANSPORT",
}


class UsageLog:
    """The logger's mutable part: the last DDP-level error, the sample rate, the sampled iteration state."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.sample_rate = _DEFAULT_SAMPLE_RATE
        self.iteration = 0
        self.rebuilt_bucket_sizes: str | None = None
        self.has_rebuilt_buckets: int | None = None  # set at the first sampled iteration, as torch's
        self._sync_forwards = 0

    def record(self, error: BaseException) -> None:
        """Keep ``error`` as torch's logger does (``"<class 'ValueError'>: message"``)."""
        self.error = f"{error.__class__}: {error}"

    def set_sample_rate(self, rate: int) -> None:
        """torch's ``_set_ddp_runtime_logging_sample_rate`` check (with its sentence); the rate only paces
        ``iteration``."""
        torch_sentence = "(DDP runtime logging sample rate should be equal or greater than 1)"
        check_int("lightning_ddpx", "the runtime logging sample rate", rate, 1, hint=torch_sentence)
        self.sample_rate = rate

    def on_sync_forward(self, rebuilt_plan: Callable[[], Sequence[BucketInfo] | None]) -> None:
        """A synchronising forward starts: at torch's sampled iterations, note how many came before it and
        the bucket sizes if the buckets were rebuilt (``rebuilt_plan()``: the plan then, else ``None``)."""
        before, self._sync_forwards = self._sync_forwards, self._sync_forwards + 1
        if before == 0 or (before > _ALWAYS_SAMPLED and before % self.sample_rate):
            return
        self.iteration = before
        plan = rebuilt_plan()
        self.has_rebuilt_buckets = int(plan is not None)
        if plan is not None:
            self.rebuilt_bucket_sizes = _joined(info.num_bytes for info in plan)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def errors_logged(method: _Method) -> _Method:
    """Decorate a DistributedDataParallel method: an error it raises is recorded in ``self._usage_log``
    (torch's logger keeps the errors its DDP raises) and propagates unchanged."""

    @functools.wraps(method)
    def logged(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            self._usage_log.record(error)
            raise

    return logged  # type: ignore[return-value]


def logging_data(
    log: UsageLog,
    module: nn.Module,
    params: Sequence[nn.Parameter],
    first_plan: Sequence[BucketInfo],
    process_group: dist.ProcessGroup,
    settings: dict[str, int | str],
) -> dict[str, int | str]:
    """torch's ``_get_ddp_logging_data()`` dict for the keys we can fill: ``settings`` carries the module's
    options already in torch's form; ``params`` are the reduced parameters, ``first_plan`` their first buckets."""
    backend = str(dist.get_backend(process_group))
    data: dict[str, int | str] = {
        "backend_name": backend,
        "world_size": dist.get_world_size(process_group),
        "rank": dist.get_rank(process_group),
        "module_name": type(module).__name__,
        "is_multi_device_module": 0,  # refused at construction
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "dtypes": _joined(sorted({_cpp_dtype_name(p.dtype) for p in params})),
        "bucket_sizes": _joined(info.num_bytes for info in first_plan),
        "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())),
        "iteration": log.iteration,
        **settings,
    }
    env = {**_ENV_KEYS, **(_GLOO_ENV_KEYS if backend == "gloo" else {})}
    data.update({key: os.environ.get(name, "N/A") for key, name in env.items()})
    if log.has_rebuilt_buckets is not None:
        data["has_rebuilt_buckets"] = log.has_rebuilt_buckets
    if log.rebuilt_bucket_sizes is not None:
        data["rebuilt_bucket_sizes"] = log.rebuilt_bucket_sizes
    if log.error is not None:
        data["has_error"] = 1
        data["error"] = log.error
    return data


def logged_options(ddp: Any) -> dict[str, int | str]:
    """A wrapped model's options in torch's logging form, read from its public attributes (torch logs
    ``static_graph`` and ``comm_hook`` only when set; the hook by its ``__qualname__``, as torch)."""
    options: dict[str, int | str] = {
        "device_ids": ", ".join(str(d) for d in ddp.device_ids or ()),
        "output_device": -1 if ddp.output_device is None else int(ddp.output_device),
        "broadcast_buffers": int(ddp.broadcast_buffers),
        "bucket_cap_bytes": megabytes_to_bytes(ddp.bucket_cap_mb),
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
    }
    if ddp.static_graph:
        options["static_graph"] = 1
    hook = ddp.comm_hook
    if hook is not None:
        options["comm_hook"] = getattr(hook, "__qualname__", None) or hook_name(hook)
    return options


def _joined(values: Iterator[object] | Sequence[object]) -> str:
    return ", ".join(str(v) for v in values)


def _cpp_dtype_name(dtype: torch.dtype) -> str:
    """The C++ type name torch's logger lists (``float``, ``double``, ``c10::Half``, ...)."""
    names = {
        torch.float32: "float",
        torch.float64: "double",
        torch.float16: "c10::Half",
        torch.bfloat16: "c10::BFloat16",
        torch.complex64: "c10::complex<float>",
        torch.complex128: "c10::complex<double>",
    }
    return names.get(dtype, str(dtype).removeprefix("torch."))
