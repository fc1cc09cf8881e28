"""Whether a process group's backend can sum bfloat16 tensors, checked when a bf16 hook is set up.

A bf16 hook on a backend that cannot reduce bfloat16 would otherwise fail in the first backward, after the
model was built and the data loaded -- or hang, if only some ranks fail. For the backends torch ships the
answer is known without communicating:

- gloo reduces bfloat16 (CPU tensors; CUDA tensors are staged through host memory);
- NCCL needs version 2.10 or later and a GPU with bfloat16 arithmetic (compute capability 8.0, Ampere);
- XCCL (Intel GPUs) reduces bfloat16;

Any other backend (MPI, UCC, a third-party plugin) is asked once per backend name with a one-element
bfloat16 allreduce, only where the caller says every rank is making the same call
(``DistributedDataParallel.register_comm_hook``, which every rank runs): a probe from one rank alone would
wait for the others until the process group's timeout. The probe costs one tiny collective per process.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import CommunicationError, waiting_for

__all__ = ["bf16_reduction_problem", "check_bf16_hook", "reduces_in_bfloat16"]

# Hook names that reduce in bfloat16: ours (the hook, and wrappers named "bf16_cast_<inner>") and torch's.
_BF16_HOOK_NAMES = ("bf16_compress_hook", "bf16_compress_wrapper_hook")
_BF16_WRAPPER_PREFIX = "bf16_cast_"
_NCCL_MIN_VERSION = (2, 10)
_probed: dict[str, str | None] = {}  # backend name -> problem found by the probe (None: it works)


def reduces_in_bfloat16(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` sends bfloat16 (torch's DDP recognises its bf16 hooks by name in the same way)."""
    name = getattr(hook, "__name__", "")
    return name in _BF16_HOOK_NAMES or name.startswith(_BF16_WRAPPER_PREFIX)


def check_bf16_hook(
    hook: Callable[..., Any],
    process_group: dist.ProcessGroup | None,
    device: torch.device | None = None,
    *,
    probe: bool = False,
) -> None:
    """Raise ``TypeError`` (torch's DDP raises the same type) if ``hook`` reduces in bfloat16 and the
    backend of ``process_group`` for ``device`` cannot. Does nothing for other hooks.

    ``probe=True`` allows a one-element collective for backends whose support is not known: pass it only
    where every rank of ``process_group`` makes this call at the same point.
    """
    if not reduces_in_bfloat16(hook):
        return
    problem = bf16_reduction_problem(process_group, device, probe=probe)
    if problem is not None:
        raise TypeError(
            f"lightning_ddpx: communication hook {getattr(hook, '__name__', hook)!r} reduces gradients in "
            f"bfloat16, but {problem}. Use fp16 compression instead (comm_hook='fp16' or comm_wrapper='fp16'), "
            "or no compression; or run on a backend that reduces bfloat16 (gloo, or NCCL >= 2.10 on a GPU "
            "with compute capability 8.0 or newer)."
        )


def bf16_reduction_problem(
    process_group: dist.ProcessGroup | None, device: torch.device | None = None, *, probe: bool = False
) -> str | None:
    """Why the backend cannot reduce bfloat16 (a phrase for an error message), or ``None`` if it can or,
    without ``probe``, if that is not known."""
    backend = _backend_for(process_group, device)
    if backend in ("gloo", "fake"):  # "fake": torch's in-process test backend, no real reduction
        return None
    if backend == "nccl":
        return _nccl_problem()
    if backend == "xccl":
        return None
    if not probe:
        return None
    if backend not in _probed:
        _probed[backend] = _probe(process_group, device, backend)
    return _probed[backend]


def _backend_for(process_group: dist.ProcessGroup | None, device: torch.device | None) -> str:
    """The backend name serving ``device`` ("cpu:gloo,cuda:nccl" names one backend per device type)."""
    name = str(dist.get_backend(process_group)).lower()
    if ":" not in name:
        return name
    per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    device_type = device.type if device is not None else ("cuda" if "cuda" in per_device else "cpu")
    return per_device.get(device_type, name)


def _nccl_problem() -> str | None:
    version = tuple(torch.cuda.nccl.version()[:3]) if torch.cuda.is_available() else ()
    if tuple(version[:2]) < _NCCL_MIN_VERSION:
        found = ".".join(map(str, version)) if version else "unavailable"
        return f"the NCCL backend (version {found}) reduces bfloat16 only from version 2.10"
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        return (
            f"this GPU ({torch.cuda.get_device_name()}) has no native bfloat16 arithmetic for NCCL to reduce "
            "with (compute capability 8.0 or newer is needed)"
        )
    return None


def _probe(process_group: dist.ProcessGroup | None, device: torch.device | None, backend: str) -> str | None:
    """One bfloat16 allreduce of a 1 per rank: the sum must be the world size (exact in bfloat16)."""
    ones = torch.ones(1, dtype=torch.bfloat16, device=device)
    try:
        with waiting_for(f"every rank to check that backend {backend!r} reduces bfloat16", process_group):
            dist.all_reduce(ones, group=process_group)
    except CommunicationError:
        raise
    except RuntimeError as error:
        return f"a one-element bfloat16 allreduce on the {backend!r} backend failed ({error})"
    expected = dist.get_world_size(process_group)
    if int(ones.item()) != expected:
        return (
            f"a bfloat16 allreduce on the {backend!r} backend summed to {ones.item()} instead of {expected}"
        )
    return None
