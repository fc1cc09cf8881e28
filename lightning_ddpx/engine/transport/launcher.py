"""Issue communication hooks so that every rank issues its collectives in one global order.

Two ways, chosen per hook (see :mod:`lightning_ddpx.engine.buckets.grad_bucket` for the contract):
- inline: the hook is called right away on the caller's (autograd) thread; only for hooks that issue all
  their collectives before returning, so buckets may be in flight together, as in torch's reducer;
- sequenced: hooks run on one communication thread, each awaited before the next starts, so hooks that
  chain collectives from callbacks, or block, still issue them in the same order on every rank.

On CUDA a task is submitted with the stream it must run on (the stream that filled the bucket): an inline
task runs at once on the submitting thread, where that stream is current already; a sequenced one runs with
it made current on the communication thread.

A sequenced hook that fails on one rank must not let that rank's later buckets issue their collectives: its
peers are still in the failed hook's next collective, and would pair it with another bucket's (the wrong
numbers when the sizes agree, a gloo abort when they do not). So the tasks of one reduction form a sequence
(:meth:`SequencedLauncher.begin_sequence`, at each backward's start); after a task fails, the rest of its
sequence fail without running, and this rank's peers see it stop instead. An inline hook needs no such
rule: its error leaves backward at once, before any later bucket is launched.

The sequenced launcher hands each result over in a future that
carries a CUDA event recorded after the result was produced (:mod:`lightning_ddpx.engine.transport.cuda_streams`),
so whoever waits for it on whatever stream is ordered after the hook's collectives; an inline hook's own
future already does this.

A task is a function and its arguments (``submit(call, *args)``), so that launching a bucket builds no
closure.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from lightning_ddpx._compat.torch import AnyFuture
from lightning_ddpx.engine.exit_threads import stop_at_exit
from lightning_ddpx.engine.transport.cuda_streams import comm_thread_stream, result_future, stream_scope

__all__ = ["InlineLauncher", "SequencedLauncher", "Task", "as_future"]

Task = Callable[..., torch.futures.Future]

# Seconds to wait for a communication thread to finish the tasks it holds when it is closed at exit.
EXIT_JOIN_TIMEOUT_S = 10.0
# Seconds ``close()`` waits by default: after a clean iteration nothing is pending and the thread ends at once;
# a task stuck on a peer that is gone is not waited for longer.
CLOSE_WAIT_S = 2.0


def as_future(result: Any) -> torch.futures.Future:
    """A task's result if it is a future; else a future failed with the error torch's DDP raises for it.

    A hook that returns something else (a tensor, a list, ``None``) is a user's slip: waiting on it would
    fail with an ``AttributeError`` far from the cause. Failing the future instead lets the reducer report
    it, naming the hook and the bucket, when it waits for that bucket.
    """
    if isinstance(result, AnyFuture):
        return result
    got = f"{type(result).__module__}.{type(result).__qualname__}"
    failed: torch.futures.Future = torch.futures.Future()
    failed.set_exception(
        RuntimeError(
            f"it returned a {got}, not a torch.futures.Future; a communication hook must return a future "
            "of the reduced bucket, e.g. dist.all_reduce(bucket.buffer(), async_op=True).get_future() "
            f"(torch: DDP communication hook's callback must return a torch.futures.Future object, but got "
            f"{got})"
        )
    )
    return failed


class InlineLauncher:
    """Run each task at once on the calling thread."""

    def submit(
        self, task: Task, *args: Any, stream: Optional["torch.cuda.Stream"] = None
    ) -> torch.futures.Future:
        """``task(*args)``, now; ``stream`` must be the calling thread's current stream (it is not entered)."""
        return as_future(task(*args))

    def begin_sequence(self) -> None:
        """A reduction starts (nothing to do: a failed inline hook raises before the next is launched)."""

    def close(self) -> None:
        pass


class SequencedLauncher:
    """Run tasks one at a time, in submission order, on a private daemon thread.

    ``submit`` returns at once with a future that completes when the task's own future does; the next
    task starts only then. An exception in a task fails that task's future, and the futures of the tasks
    submitted after it in the same sequence (see the module's docstring) without running them. ``device``:
    where the tasks' results live; on CUDA the returned futures carry CUDA events (see the module's
    docstring), so ``wait()`` orders the waiter's current stream after the result.
    """

    def __init__(self, name: str = "lightning_ddpx-comm", device: torch.device | None = None) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._name = name
        self._device = device if device is not None else torch.device("cpu")
        self._thread: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, self._queue.put, None)
        self._sequence = 0

    def begin_sequence(self) -> None:
        """The tasks submitted from now on form a new sequence: a failure before it no longer stops them."""
        self._sequence += 1

    def submit(
        self, task: Task, *args: Any, stream: Optional["torch.cuda.Stream"] = None
    ) -> torch.futures.Future:
        """``task(*args)`` on the communication thread, with ``stream`` (CUDA) current there."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=_serve, args=(self._queue, self._device), name=self._name, daemon=True
            )
            self._thread.start()
            stop_at_exit(self, self._name, EXIT_JOIN_TIMEOUT_S)
        done = result_future(self._device)
        self._queue.put((task, args, stream, done, self._sequence))
        return done

    def close(self, timeout: float | None = CLOSE_WAIT_S) -> bool:
        """Stop the thread after the tasks already submitted; wait at most ``timeout`` s for it (``None``:
        do not wait), so a module closed at the end of training leaves no thread behind.

        Returns whether the thread has ended (always ``True`` with ``None``).
        """
        self._finalizer()
        thread = self._thread
        if timeout is None or thread is None or thread is threading.current_thread():
            return timeout is None or thread is None
        thread.join(timeout)
        return not thread.is_alive()


# task, args, stream, result, sequence
_Item = tuple[Task, tuple, Optional["torch.cuda.Stream"], torch.futures.Future, int]


def _serve(tasks: "queue.SimpleQueue[_Item | None]", device: torch.device) -> None:
    # CUDA: wait for each task's future on this thread's own stream, then complete ``done`` there, which
    # records an event after the result; the consumer's ``done.wait()`` waits for that event on its stream.
    stream = comm_thread_stream(device)  # None off CUDA
    failed: tuple[int, BaseException] | None = None  # the sequence a task failed in, and its error
    while True:
        item = tasks.get()
        if item is None:
            return
        task, args, task_stream, done, sequence = item
        if failed is not None and failed[0] == sequence:
            done.set_exception(_not_run_after(failed[1]))
            continue
        try:
            with stream_scope(stream):
                with stream_scope(task_stream):
                    future = as_future(task(*args))
                value: Any = future.wait()
                done.set_result(value)
        except BaseException as error:  # noqa: BLE001 - the waiting side re-raises it
            done.set_exception(error)
            failed = (sequence, error)


def _not_run_after(error: BaseException) -> RuntimeError:
    """The error of a task not run because an earlier one of its sequence failed with ``error``."""
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    return RuntimeError(
        f"not run: an earlier hook call of this reduction failed on this rank ({type(error).__name__}: "
        f"{first_line}), so this rank issues no further collective its peers could pair with the wrong one"
    )
