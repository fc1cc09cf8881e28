"""CUDA streams in the reducer: ordering by construction, never a host synchronisation.

On the CPU (gloo) there are no streams and every function here is a no-op. On CUDA (NCCL):

- a parameter's gradient hook runs on the stream that produced its gradient (the autograd engine makes the
  node's stream current); the reducer notes that stream per parameter;
- a bucket is filled when its last gradient arrives, on that hook's current stream (the *launch* stream).
  A gradient produced on another stream is copied on *its* stream, and the launch stream then waits for
  that stream (``wait_stream``: an event on the GPU, not on the host);
- the hook is called with the launch stream current, also when it runs on the communication thread, so
  the collectives it issues (NCCL orders its own stream after the current one) see the filled bucket;
- at the end of backward each bucket's result is waited for on the current stream (torch's CUDA futures
  do this in ``wait()``; for any other future the current stream waits for the launch stream), and the
  averaged gradients are written on the current stream, which the autograd engine has already ordered
  after every gradient-producing stream.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, TypeVar

import torch

__all__ = ["current_stream", "on_stream", "wait_streams"]

T = TypeVar("T")


def current_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The current CUDA stream of ``device``; ``None`` for any other device type."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def on_stream(stream: Optional["torch.cuda.Stream"], call: Callable[[], T]) -> Callable[[], T]:
    """``call`` made to run with ``stream`` current, wherever (whichever thread) it runs."""
    if stream is None:
        return call

    def run() -> T:
        with torch.cuda.stream(stream):
            return call()

    return run


def wait_streams(
    waiter: Optional["torch.cuda.Stream"], streams: Iterable[Optional["torch.cuda.Stream"]]
) -> None:
    """Make ``waiter`` wait (on the GPU) for the work queued so far on each other stream."""
    if waiter is None:
        return
    for stream in set(s for s in streams if s is not None and s != waiter):
        waiter.wait_stream(stream)
