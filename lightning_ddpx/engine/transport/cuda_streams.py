"""CUDA streams in the reducer: ordering by construction, never a host synchronisation.

On the CPU (gloo) there are no streams and every function here is a no-op. On CUDA (NCCL):

- a parameter's gradient hook runs on the stream that produced its gradient (the autograd engine makes the
  node's stream current); the reducer notes that stream per parameter, as torch's raw (id, device, type)
  triple, without building a ``Stream`` object (the per-gradient path; objects are made only for the rare
  gradient from another stream);
- a bucket is filled when its last gradient arrives, on that hook's current stream (the *launch* stream).
  A gradient produced on another stream is copied on *its* stream, and the launch stream then waits for
  that stream (``wait_stream``: an event on the GPU, not on the host);
- the hook is called with the launch stream current, also when it runs on the communication thread, so
  the collectives it issues (NCCL orders its own stream after the current one) see the filled bucket;
- a result travels only in a future that carries the CUDA events of the work producing it, as torch's
  CUDA futures do: an inline hook's own future (NCCL's, or one chained from it), or, for a hook run on the
  communication thread, the launcher's :func:`result_future`, completed on that thread's private stream
  (:func:`comm_thread_stream`) once that stream waited for the hook's future -- never the default stream,
  which training may be computing on;
- at the end of backward each bucket's result is waited for on the current stream (``Future.wait()`` makes
  the current stream wait for those events, without blocking the host; for a future without events the
  current stream also waits for the launch stream), and the averaged gradients are written on the current
  stream, which the autograd engine has already ordered after every gradient-producing stream.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterable, Optional, Sequence

import torch

from lightning_ddpx._compat.torch import cuda_current_stream_key, cuda_stream_of_key

__all__ = [
    "GradientStreams",
    "comm_thread_stream",
    "current_stream",
    "result_future",
    "stream_scope",
    "wait_streams",
]


def current_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The current CUDA stream of ``device``; ``None`` for any other device type."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def wait_streams(
    waiter: Optional["torch.cuda.Stream"], streams: Iterable[Optional["torch.cuda.Stream"]]
) -> None:
    """Make ``waiter`` wait (on the GPU) for the work queued so far on each other stream."""
    if waiter is None:
        return
    for stream in set(s for s in streams if s is not None and s != waiter):
        waiter.wait_stream(stream)


def stream_scope(stream: Optional["torch.cuda.Stream"]) -> ContextManager[None]:
    """A context in which ``stream`` is current on its device (nothing for ``None``)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def result_future(device: torch.device) -> torch.futures.Future:
    """A future for a result on ``device``. On CUDA it is torch's CUDA-aware future: ``set_result`` records an
    event on the setting thread's current stream, and ``wait()`` makes the waiting thread's current stream
    wait for that event (no host synchronisation). Elsewhere a plain future."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def comm_thread_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """Called once on a communication thread serving ``device``: make ``device`` the thread's current
    device (a new thread starts on device 0), and return a stream private to the thread, on which it waits
    for hooks' results (``None`` off CUDA).

    Why a private stream: ``Future.wait()`` makes the *current* stream wait for the hook's collectives. On a
    new thread that is the device's default stream, which the training may be computing on: its next
    kernels would queue behind this bucket's communication (no overlap), and a consumer on any other stream
    would not be ordered after the result at all."""
    if device.type != "cuda":
        return None
    torch.cuda.set_device(device)
    return torch.cuda.Stream(device)


StreamKey = tuple[int, int, int]  # torch's (stream id, device index, device type) of a CUDA stream


def stream_key(stream: "torch.cuda.Stream") -> StreamKey:
    """The triple :data:`~lightning_ddpx._compat.torch.cuda_current_stream_key` gives for ``stream``."""
    return (stream.stream_id, stream.device_index, stream.device_type)


class GradientStreams:
    """CUDA: the stream that produced each parameter's gradient in this backward (``None``: not produced,
    or not on CUDA), so that a bucket's launch stream is ordered after all of them."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._producer: list[Optional[StreamKey]] = [None] * len(params)
        self._device_index = [p.device.index if p.device.type == "cuda" else -1 for p in params]

    def note(self, index: int, param: torch.nn.Parameter, view: torch.Tensor | None) -> None:
        """Parameter ``index``'s gradient was just produced, on the current stream: remember that stream.
        With bucket views (``view``), copy the gradient into its view on that stream now (the tensor autograd
        made is freed right after, so the copy must not outlive it on another stream). On the CPU, views
        adopt their gradients in one batched copy at launch instead."""
        self._producer[index] = cuda_current_stream_key(self._device_index[index])
        if view is not None and param.grad is not view:
            with torch.no_grad():
                view.copy_(param.grad)
            param.grad = view

    def forget(self, index: int) -> None:
        """Parameter ``index`` has no gradient from this backward (a kept one is copied on the launch stream)."""
        self._producer[index] = None

    def others(
        self, indices: Iterable[int], stream: Optional["torch.cuda.Stream"]
    ) -> list["torch.cuda.Stream"]:
        """Streams other than ``stream`` that produced gradients of these parameters (usually none)."""
        if stream is None:
            return []
        producers, own = self._producer, stream_key(stream)
        other_keys = {producers[i] for i in indices if producers[i] is not None and producers[i] != own}
        return [cuda_stream_of_key(key) for key in other_keys]

    @torch.no_grad()
    def copy_on_producers(
        self,
        indices: Sequence[int],
        params: Sequence[torch.nn.Parameter],
        views: Sequence[torch.Tensor],
        scale: float | None,
        stream: "torch.cuda.Stream",
    ) -> None:
        """Gradients from several streams: copy each into its view on the stream that produced it, then make
        ``stream`` wait for those streams (GPU events, no host synchronisation)."""
        producers = []
        for index, param, view in zip(indices, params, views):
            if param.grad is None:
                view.zero_()
                continue
            key = self._producer[index]
            producer = cuda_stream_of_key(key) if key is not None else stream  # kept: on the launch stream
            producers.append(producer)
            with torch.cuda.stream(producer):
                if scale is None:
                    view.copy_(param.grad)
                else:
                    torch.mul(param.grad, scale, out=view)
        wait_streams(stream, producers)
