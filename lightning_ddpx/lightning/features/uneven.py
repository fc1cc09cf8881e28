"""Uneven inputs in the strategies: every rank iterates its training loader in lockstep with the others.

Lightning's loops and a Fabric user's loop run collectives of their own between gradient reductions
(Lightning broadcasts a SIGTERM flag every step, ``self.log(sync_dist=True)`` reduces, checkpoints gather
and barrier, SyncBatchNorm reduces inside forward). A module-level join cannot shadow those: it only knows
its own collectives. So the strategies keep the ranks in step one level up, at the data:

- each ``next()`` on a rank's loader is one small allreduce saying which ranks still have a batch (started
  one batch ahead, so it travels while the previous step trains);
- while at least one has, a rank that ran out *replays* its last batch (a rank that never had one gets a
  copy of the lowest active rank's current batch, once) and its backward is multiplied by zero, so it runs
  exactly the code -- and the collectives -- of a real step but contributes a zero gradient; the gradient
  is still averaged over the full world size (torch's ``divide_by_initial_world_size=True``) and every rank
  applies the same update, so parameters and optimizer states stay identical on all ranks;
- when no rank has a batch left, every rank's loader ends at the same ``next()``: the epoch ends on all
  ranks together and validation, logging and checkpointing run as usual.

When every rank's loader is a map-style ``DataLoader`` (whose length is exact: it is its batch sampler's)
and the lengths are equal -- Lightning's default ``DistributedSampler`` makes them so -- the ranks cannot
fall out of step, and the loaders are iterated as they are: no per-batch allreduce, nothing to pay.

``uneven_inputs="error"`` raises :class:`UnevenInputsError` on every rank at that first ``next()`` instead,
naming each rank's batch count; ``"off"`` leaves the loader alone (Lightning's ``ddp`` behaviour: a hang).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_ddpx.engine.agreement.errors import waiting_for

__all__ = [
    "UNEVEN_INPUTS",
    "LockstepLoader",
    "StepInfo",
    "StepQueue",
    "UnevenInputsError",
    "check_uneven_inputs",
]

UnevenInputs = Literal["join", "error", "off"]
UNEVEN_INPUTS: tuple[str, ...] = ("join", "error", "off")

# rows of the per-batch exchange; one column per rank
_HAS_BATCH, _HAS_REPLAY, _SERVED = range(3)


class UnevenInputsError(RuntimeError):
    """Ranks have different numbers of training batches and ``uneven_inputs="error"`` was chosen."""


@dataclass(frozen=True)
class StepInfo:
    """What the ranks agreed for one batch."""

    replay: bool  # this rank has no batch left: it replays one with a zero-weighted backward
    # The lowest rank with a real batch: buffers are broadcast from it. Rank 0 whenever it has a batch, as
    # without uneven inputs, so the buffers rank 0 writes into a checkpoint are the ones a resume broadcasts.
    authority: int


def check_uneven_inputs(value: Any) -> str:
    """Validate the ``uneven_inputs`` option (strategy constructors call this before anything starts)."""
    if value not in UNEVEN_INPUTS:
        raise ValueError(
            f"DDPXStrategy: uneven_inputs must be one of {list(UNEVEN_INPUTS)}, got {value!r}. 'join' (default) "
            "lets ranks with fewer batches replay with zero weight until all are done; 'error' raises naming "
            "each rank's batch count; 'off' does nothing (a rank with more batches waits until the timeout)."
        )
    return value


class StepQueue:
    """The :class:`StepInfo` of fetched batches not yet trained on (Lightning fetches ahead).

    The Trainer strategy calls :meth:`advance` when a batch's step starts and reads ``current``; Fabric's
    loop uses a batch as soon as it is fetched, so the Fabric strategy reads ``latest``.
    """

    def __init__(self, on_push: Optional[Callable[[StepInfo], None]] = None) -> None:
        self._pending: deque[StepInfo] = deque()
        self.current: Optional[StepInfo] = None
        self.latest: Optional[StepInfo] = None
        self._on_push = on_push

    def reset(self) -> None:
        self._pending.clear()
        self.current = self.latest = None

    def push(self, info: StepInfo) -> None:
        self._pending.append(info)
        self.latest = info
        if self._on_push is not None:
            self._on_push(info)

    def advance(self) -> Optional[StepInfo]:
        """The batch about to be trained on: the oldest fetched one."""
        self.current = self._pending.popleft() if self._pending else None
        return self.current

    @property
    def replaying(self) -> bool:
        return self.current is not None and self.current.replay


class LockstepLoader:
    """Wraps a rank's training loader so all ranks take the same number of steps (see the module doc).

    ``len()`` is the longest rank's length (every rank agrees on the epoch length, e.g. for
    ``val_check_interval``), or absent if any rank's loader has none. Other attributes (``sampler``,
    ``batch_size``, ``dataset``) are the wrapped loader's. ``steps`` receives a :class:`StepInfo` at each
    ``next()`` that yields a batch, in order (Lightning fetches one batch ahead for unsized loaders).

    ``for_fabric=True``: Fabric cannot tell training from evaluation loaders, and users often evaluate on
    rank 0 alone. So no collective happens at construction (the lengths are gathered at the first lockstep
    iteration; until then ``len()`` is this rank's), and a loop entered with gradients disabled
    (``torch.no_grad()``, inference mode: evaluation) iterates the plain loader.
    """

    def __init__(
        self,
        loader: Any,
        mode: UnevenInputs,
        process_group: dist.ProcessGroup,
        device: torch.device,
        steps: StepQueue,
        for_fabric: bool = False,
    ) -> None:
        self.loader = loader
        self.for_fabric = for_fabric
        self.mode = mode
        self.process_group = process_group
        self.device = device
        self.steps = steps
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._lengths: Optional[list[int]] = None
        self._gathered = False
        # a stateful loader's state before the batch fetched ahead (see _state_dict); None: no look-ahead
        self._state_before_lookahead: Optional[Any] = None
        # Stateful only where the wrapped loader is: Lightning's check (a runtime Protocol) reads the class
        # and instance attributes only (Python 3.12+), not __getattr__, so these are set on the instance.
        self._stateful = hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
        if self._stateful:
            self.state_dict = self._state_dict
            self.load_state_dict = loader.load_state_dict
        if not for_fabric:
            self._gather_lengths()

    def _gather_lengths(self) -> None:
        """Every rank's ``len()`` (a collective); raises in ``"error"`` mode if they differ."""
        self._lengths, self._gathered = self._all_lengths(), True
        if self.mode == "error" and self._lengths is not None and len(set(self._lengths)) > 1:
            counts = ", ".join(f"rank {r}: {n}" for r, n in enumerate(self._lengths))
            raise UnevenInputsError(
                f"lightning_ddpx: ranks have different numbers of training batches (uneven_inputs='error'): "
                f"{counts}. {_FIX}"
            )

    def _all_lengths(self) -> Optional[list[int]]:
        try:
            local = len(self.loader)
        except (TypeError, NotImplementedError):
            local = -1
        lengths = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        lengths[self.rank] = local
        with waiting_for("every rank's training loader length (uneven_inputs)", self.process_group):
            dist.all_reduce(lengths, group=self.process_group)
        values = lengths.tolist()
        return None if min(values) < 0 else values

    def __len__(self) -> int:
        if not self._gathered:
            return len(self.loader)
        if self._lengths is None:
            raise TypeError("a rank's training loader has no length")
        return max(self._lengths)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _state_dict(self) -> Any:
        """A stateful loader's state as of the batches handed to training. To agree with the other ranks on
        who still has data, the lockstep fetches each next batch ahead; the wrapped loader's own state
        already counts it, and a run resumed from it would skip that batch (a mid-epoch checkpoint)."""
        if self._state_before_lookahead is not None:
            return self._state_before_lookahead
        return self.loader.state_dict()

    def __iter__(self) -> Iterator[Any]:
        self.steps.reset()  # a new epoch (or an iterator Lightning made and dropped): nothing is pending
        self._state_before_lookahead = None
        if self.for_fabric:
            if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
                return iter(self.loader)  # evaluation: maybe on one rank only, no backward to keep in step
            if not self._gathered:
                self._gather_lengths()
        return self._lockstep(iter(self.loader))

    def _even_by_length(self) -> bool:
        """Whether equal lengths prove equal batch counts: they are equal and the length is exact
        (a map-style ``DataLoader``'s; an ``IterableDataset`` may yield more or fewer than it says)."""
        loader = self.loader
        return (
            self._lengths is not None
            and len(set(self._lengths)) == 1
            and isinstance(loader, DataLoader)
            and not isinstance(loader.dataset, IterableDataset)
        )

    def _lockstep(self, iterator: Iterator[Any]) -> Iterator[Any]:
        if self._even_by_length():
            for batch in iterator:
                self.steps.push(StepInfo(replay=False, authority=0))
                yield batch
            self.steps.latest = None
            return
        served = 0
        replay: list[Any] = []  # the batch this rank replays once its own are exhausted
        pending = self._start_exchange(iterator, served, has_replay=False)
        while True:
            batch, has_batch, table = self._finish_exchange(*pending)
            active = [r for r in range(self.world_size) if table[_HAS_BATCH][r]]
            if not active:
                self.steps.latest = None
                return
            if len(active) < self.world_size and self.mode == "error":
                raise UnevenInputsError(_uneven_message(table, self.world_size))
            needy = [
                r for r in range(self.world_size) if not table[_HAS_BATCH][r] and not table[_HAS_REPLAY][r]
            ]
            if needy:
                donated = self._donate(batch, min(active))
                if not has_batch and not replay:
                    replay.append(donated)
            if has_batch:
                served += 1
                replay[:] = [batch]
            self.steps.push(StepInfo(replay=not has_batch, authority=min(active)))
            # The next batch's flags travel while this step trains: the allreduce's latency is hidden.
            pending = self._start_exchange(iterator, served, has_replay=bool(replay))
            yield batch if has_batch else replay[0]

    def _start_exchange(
        self, iterator: Iterator[Any], served: int, has_replay: bool
    ) -> tuple[Any, bool, torch.Tensor, Any]:
        """Fetch this rank's next batch and start the allreduce of every rank's flags (asynchronous)."""
        if self._stateful:
            self._state_before_lookahead = self.loader.state_dict()
        try:
            batch, has_batch = next(iterator), True
        except StopIteration:
            batch, has_batch = None, False
        table = torch.zeros(3, self.world_size, dtype=torch.int64, device=self.device)
        table[_HAS_BATCH, self.rank] = int(has_batch)
        table[_HAS_REPLAY, self.rank] = int(has_replay)
        table[_SERVED, self.rank] = served
        return batch, has_batch, table, dist.all_reduce(table, group=self.process_group, async_op=True)

    def _finish_exchange(
        self, batch: Any, has_batch: bool, table: torch.Tensor, work: Any
    ) -> tuple[Any, bool, list[list[int]]]:
        with waiting_for("the other ranks' 'I have a batch' flags (uneven_inputs)", self.process_group):
            work.wait()
        return batch, has_batch, table.tolist()

    def _donate(self, batch: Any, donor: int) -> Any:
        """A rank that never had a batch gets a copy of ``donor``'s current one to replay (once)."""
        holder = [batch if self.rank == donor else None]
        with waiting_for(f"rank {donor}'s batch, to replay on a rank without input", self.process_group):
            dist.broadcast_object_list(holder, group=self.process_group, group_src=donor, device=self.device)
        return holder[0]


def _uneven_message(table: list[list[int]], world_size: int) -> str:
    done = [r for r in range(world_size) if not table[_HAS_BATCH][r]]
    more = [r for r in range(world_size) if table[_HAS_BATCH][r]]
    counts = ", ".join(
        f"rank {r}: {table[_SERVED][r]}{' and more' if table[_HAS_BATCH][r] else ''}"
        for r in range(world_size)
    )
    return (
        f"lightning_ddpx: ranks have different numbers of training batches (uneven_inputs='error'): rank(s) "
        f"{done} ran out while rank(s) {more} still have batches. Batches per rank so far: {counts}. {_FIX}"
    )


_FIX = (
    "Give every rank the same number of batches (a DistributedSampler, drop_last, or an IterableDataset that "
    "splits evenly), or set uneven_inputs='join' to let ranks that run out contribute zero gradients until all "
    "are done."
)
