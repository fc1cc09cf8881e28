"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``), as torch's DDP treats them.

A sparse gradient holds only the rows a batch touched, so it cannot be copied into a flat dense bucket. As in
torch, each parameter expected to produce one gets a bucket of its own; the communication hook sees that
gradient itself as ``bucket.buffer()`` (a sparse tensor; ``gradients()`` is empty, as in torch), and with no
hook registered it is divided by the world size and sum-all-reduced as a sparse tensor (gloo supports it).
The reduced sparse tensor becomes ``param.grad``.

Hooks that compress dense buffers (casts to fp16/bf16, PowerSGD, quantisation) cannot reduce a sparse tensor:
torch's fail deep inside a backward or, for PowerSGD, return wrong values. They are refused when registered
on a module that has sparse gradients (:func:`sparse_refusal`).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, TypeVar

import torch
from torch import nn

__all__ = [
    "dense_buckets_only",
    "empty_sparse_like",
    "expects_sparse_gradients",
    "refuse_dense_only_hook",
    "sparse_refusal",
]

HookT = TypeVar("HookT", bound=Callable)

_DENSE_ONLY_ATTRIBUTE = "_lightning_ddpx_dense_buckets_only"


def expects_sparse_gradients(module: nn.Module, params: Sequence[nn.Parameter]) -> list[bool]:
    """For each of ``params``: whether it is the weight of an embedding layer of ``module`` built with
    ``sparse=True`` (torch's rule: the only layers whose gradient DDP expects to be sparse)."""
    sparse = {
        id(layer.weight)
        for layer in module.modules()
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse
    }
    return [id(p) in sparse for p in params]


def dense_buckets_only(hook: HookT) -> HookT:
    """Mark ``hook`` as unable to reduce a sparse gradient: registering it on a module with sparse gradients
    then raises at once, naming the parameters, instead of failing inside a backward."""
    setattr(hook, _DENSE_ONLY_ATTRIBUTE, True)
    return hook


def sparse_refusal(hook: Callable) -> str | None:
    """Why ``hook`` cannot reduce sparse gradients, or ``None`` when it may (unknown hooks are trusted:
    torch's DDP hands them sparse buckets too, and a failure is reported naming the bucket)."""
    if getattr(hook, _DENSE_ONLY_ATTRIBUTE, False):
        return "it compresses dense buffers"
    name = getattr(hook, "__qualname__", "") or ""
    if hook in _torch_dense_hooks() or "compress_wrapper" in name:
        return "it compresses dense buffers (torch's hook fails, or returns wrong values, on a sparse tensor)"
    return None


def refuse_dense_only_hook(
    hook: Callable, hook_name: str, names: Sequence[str], sparse: Sequence[bool]
) -> None:
    """``ValueError`` if ``hook`` (named ``hook_name``) cannot reduce sparse gradients and some of the
    parameters ``names`` produce them (``sparse``)."""
    sparse_names = [name for name, flag in zip(names, sparse) if flag]
    refusal = sparse_refusal(hook) if sparse_names else None
    if refusal is not None:
        raise ValueError(
            f"lightning_ddpx: the communication hook {hook_name} cannot reduce sparse gradients "
            f"({refusal}), and parameter(s) {sparse_names} produce them (nn.Embedding/nn.EmbeddingBag with "
            "sparse=True). Register no hook (the default averages sparse gradients with a sparse "
            "all-reduce) or the allreduce hook, or build those layers with sparse=False."
        )


@functools.lru_cache(maxsize=1)
def _torch_dense_hooks() -> tuple[Callable, ...]:
    """torch's hooks that fail or compute wrong values on a sparse bucket (checked with torch 2.13 over gloo:
    fp16 fails in its cast back, PowerSGD doubles the gradient, batched PowerSGD fails to resize)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks

    return (
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
        powerSGD_hook.powerSGD_hook,
        powerSGD_hook.batched_powerSGD_hook,
        quantization_hooks.quantization_pertensor_hook,
        quantization_hooks.quantization_perchannel_hook,
    )


def empty_sparse_like(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``param`` with no rows: the contribution of a rank that holds none (an embedding
    unused on this rank), laid out like an embedding's gradient (one sparse dimension)."""
    return torch.sparse_coo_tensor(
        torch.empty((1, 0), dtype=torch.int64, device=param.device),
        torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device),
        param.shape,
    )
