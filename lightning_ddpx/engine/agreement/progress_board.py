"""Hang diagnosis: what every rank was last doing, read from the store when a collective fails.

Each rank keeps its last started collective in memory (a string assignment per bucket) and copies it into
the process group's store under one key per rank (``lightning_ddpx/round<N>/progress/<rank>``, overwritten,
so the store stays bounded; the launcher's restart round ``N`` keeps a killed round's records out of the next
round's reports: :mod:`~lightning_ddpx.engine.agreement.launch_round`) at most every ``PROGRESS_INTERVAL_S`` seconds, or at every record with
``DDPX_DEBUG=1``. When a collective fails or times out, :func:`peer_report` first writes this rank's exact
state, waits briefly for the other ranks' own final writes, and reads every rank's key -- no collective,
so it works while the group is broken. A rank that died or is busy elsewhere shows its last periodic
record and how old it is. A rank that its launcher, in this process, saw end (:func:`note_lost`: the
strategies' popen launcher) writes no final record: the report stops waiting for it and says how it ended.
(The ``DDPX_DEBUG=1`` bucket-sequence check is :mod:`~lightning_ddpx.engine.agreement.sequence_check`.)
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from lightning_ddpx._compat.torch import default_store, process_group_store
from lightning_ddpx.engine.agreement.launch_round import round_prefix
from lightning_ddpx.engine.exit_threads import stop_at_exit

__all__ = [
    "DEBUG_ENV",
    "PROGRESS_INTERVAL_S",
    "ProgressBoard",
    "debug_enabled",
    "note_lost",
    "peer_report",
]

DEBUG_ENV = "DDPX_DEBUG"
PROGRESS_INTERVAL_S = 0.5  # store writes per rank at most this often (one TCP round trip each)
_STORE_TIMEOUT_S = 1.0  # longest a store operation of the diagnosis may block
_FINAL_GRACE_S = 1.0  # how long a failing rank waits for the other ranks' final records
_KEY = "{prefix}{rank}"  # the prefix: this launcher round's (round_prefix("progress"))
WRITER_THREAD_NAME = "lightning_ddpx-progress"
_CLOSE_WAIT_S = 2 * _STORE_TIMEOUT_S  # longest wait for the writer at close: a write in flight is bounded
_IDLE_EXIT_S = 10 * PROGRESS_INTERVAL_S  # the writer ends after this long without a record; restarts on one
# id(process group) -> the board of the latest module on it; weak, so a collected module's board goes too
_BOARDS: "weakref.WeakValueDictionary[int, ProgressBoard]" = weakref.WeakValueDictionary()
# global rank -> how it ended, as a launcher in this process saw it (note_lost); a report waiting for final
# records is woken when one is added
_LOST: dict[int, str] = {}
_LOST_NOTED = threading.Condition()


def debug_enabled() -> bool:
    """``DDPX_DEBUG=1`` (or ``true``/``detail``): check bucket sequences and record progress precisely."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "detail")


class ProgressBoard:
    """This rank's last started collective, in memory and (rate-limited) in the process group's store.

    The training thread never touches the store: it assigns a string and, when a write is due, wakes a
    writer thread. A store that cannot be reached (its host died, the link is down) then delays nothing
    but the diagnosis, and the failure report itself is bounded in time.
    """

    def __init__(self, process_group: dist.ProcessGroup, debug: bool | None = None) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.debug = debug_enabled() if debug is None else debug
        self._last: tuple[str, tuple] = ("nothing yet", ())  # format and arguments, formatted when read
        self._written_at = float("-inf")
        self._stamp = 0.0  # wall time of the record the writer thread writes next
        self._store = _store_of(process_group)
        self._prefix = round_prefix("progress")
        self._wake = threading.Event()
        self._writer: _Writer | None = None
        self._writer_lock = threading.Lock()  # starting and idle-ending the writer
        self._closed = False
        # how long a rank whose collective failed waits for the others' final records before raising
        # (DistributedDataParallel.failure_report_wait_s; fault tolerance sets 0: a lost rank writes none)
        self.final_grace_s = _FINAL_GRACE_S
        weakref.finalize(self, self._wake.set)  # a collected board ends its writer
        _BOARDS[id(process_group)] = self

    @property
    def last(self) -> str:
        """What this rank last started, as text."""
        what, args = self._last
        return what.format(*args) if args else what

    def record(self, what: str, *args: object) -> None:
        """Note that this rank starts ``what`` (``what.format(*args)``: the text is built only when read);
        cheap: a tuple assignment, and a store write, when due, happens on another thread."""
        self._last = (what, args)  # one assignment: a reader on another thread sees a matching pair
        now = time.monotonic()
        if self.debug or now - self._written_at >= PROGRESS_INTERVAL_S:
            self._written_at = now
            self._stamp = time.time()
            with self._writer_lock:
                if self._writer is None and self._store is not None and not self._closed:
                    self._writer = _Writer(self)
                    self._writer.start()
                    stop_at_exit(self, WRITER_THREAD_NAME, _CLOSE_WAIT_S)
                self._wake.set()

    def close(self, timeout: float | None = _CLOSE_WAIT_S) -> bool:
        """Stop the writer thread (the module is closed) and wait at most ``timeout`` s for it to end
        (``None``: do not wait). Returns whether it has ended (always ``True`` with ``None``).

        Waiting by default: a module closed at the end of training leaves no thread behind (a notebook or
        test process that trains again would otherwise accumulate them); the wait is bounded, because
        a write in flight is."""
        self._closed = True
        self._wake.set()
        writer = self._writer
        if timeout is None or writer is None or writer is threading.current_thread():
            return timeout is None or writer is None
        writer.join(timeout)
        return not writer.is_alive()

    def _writer_done(self, writer: _Writer, idle: bool) -> bool:
        """Whether ``writer`` ends now: the board is closed or has no store, it was stopped, or (``idle``)
        no record woke it for ``_IDLE_EXIT_S``. An ending writer leaves its slot free for the next record."""
        with self._writer_lock:
            if idle and self._wake.is_set():  # a record came in just now: serve it
                idle = False
            done = idle or writer.stopping or self._closed or self._store is None
            if done and self._writer is writer:
                self._writer = None
            if not done:
                self._wake.clear()
            return done

    def _write(self, kind: str, what: str, stamp: float) -> None:
        store = self._store
        if store is None:
            return
        try:
            store.set(_KEY.format(prefix=self._prefix, rank=self.rank), f"{kind}|{stamp:.3f}|{what}")
        except Exception:  # noqa: BLE001 - diagnosis must never break training; the store may be gone
            self._store = None

    def report(self, grace_s: float = _FINAL_GRACE_S) -> str:
        """Every other rank's last record (waiting up to ``grace_s`` for their final ones), as one sentence.

        Runs on a helper thread and gives up after ``grace_s`` + ``_STORE_TIMEOUT_S``: an unreachable store
        must not hold back the error it decorates.
        """
        answer: list[str] = []
        helper = threading.Thread(target=lambda: answer.append(self._read_peers(grace_s)), daemon=True)
        helper.start()
        helper.join(grace_s + _STORE_TIMEOUT_S + 0.5)
        if answer:
            return answer[0]
        return (
            "What the other ranks were doing is unknown: the process group's store did not answer (it lives on "
            "rank 0's host: that host or the link to it may be down)."
        )

    def _read_peers(self, grace_s: float) -> str:
        self._write("F", self.last, time.time())
        store = self._store
        if store is None:
            return "What the other ranks were doing is unknown: the process group's store is unreachable."
        keys = {r: _KEY.format(prefix=self._prefix, rank=r) for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + grace_s
        records: dict[int, str] = {}
        lost: dict[int, str] = {}
        try:
            while True:
                for r, key in keys.items():
                    if store.check([key]):
                        records[r] = store.get(key).decode()
                lost = self._lost_peers(keys)
                if all(r in lost or records.get(r, "").startswith("F|") for r in keys):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                with _LOST_NOTED:  # a lost rank noted meanwhile ends the wait for its record at once
                    _LOST_NOTED.wait(min(0.1, left))
        except Exception:  # noqa: BLE001 - rank 0 hosts the store: it may have died
            if not records:
                return (
                    "What the other ranks were doing is unknown: the process group's store stopped answering "
                    "(it lives on rank 0, which may have died)."
                )
        return (
            "Other ranks, last started: "
            + "; ".join(_describe_record(r, records.get(r), lost.get(r)) for r in sorted(keys))
            + "."
        )

    def _lost_peers(self, group_ranks: "dict[int, str]") -> dict[int, str]:
        """The ranks among ``group_ranks`` (of this board's group) noted lost, with how they ended."""
        if not _LOST:
            return {}
        found = {}
        for r in group_ranks:
            try:
                how = _LOST.get(dist.get_global_rank(self.process_group, r))
            except Exception:  # noqa: BLE001 - best effort: the group may already be gone
                how = _LOST.get(r)
            if how is not None:
                found[r] = how
        return found


class _Writer(threading.Thread):
    """The thread that copies a board's record into the store when due. It holds the board weakly and
    ends when the board is closed or collected, when idle for ``_IDLE_EXIT_S``, or on :meth:`stop`; the
    next record due starts a new one. A daemon with a ``stop()`` method, as test fixtures that stop
    left-over daemon threads (Lightning's) expect."""

    def __init__(self, board: ProgressBoard) -> None:
        super().__init__(name=WRITER_THREAD_NAME, daemon=True)
        self._board = weakref.ref(board)
        self._wake = board._wake
        self.stopping = False

    def run(self) -> None:
        while True:
            woke = self._wake.wait(_IDLE_EXIT_S)
            board = self._board()
            if board is None or board._writer_done(self, idle=not woke):
                return
            board._write("P", board.last, board._stamp)
            del board  # hold the board only while writing

    def stop(self, timeout: float = _CLOSE_WAIT_S) -> None:
        """End this thread now (waiting at most ``timeout`` s); records due later start a new one."""
        self.stopping = True
        self._wake.set()
        if self is not threading.current_thread():
            self.join(timeout)


def _describe_record(rank: int, record: str | None, lost: str | None = None) -> str:
    if lost is not None:  # its last record, periodic: it may have started more since
        if record is None:
            return f"rank {rank}: nothing of this module; then it {lost}"
        _, stamp, what = record.split("|", 2)
        age = max(0.0, time.time() - float(stamp))
        return f"rank {rank}: {what} (recorded {age:.1f} s ago); then it {lost}"
    if record is None:
        return f"rank {rank}: no record (it has not started a collective of this module)"
    kind, stamp, what = record.split("|", 2)
    age = max(0.0, time.time() - float(stamp))
    if kind == "F":
        return f"rank {rank}: {what} (it failed too, {age:.1f} s ago)"
    return (
        f"rank {rank}: {what} (recorded {age:.1f} s ago and not failed since: it may be dead, stuck outside "
        "lightning_ddpx's collectives (data loading, a collective of its own), or slow)"
    )


def note_lost(rank: int, how: str) -> None:
    """A launcher in this process saw global rank ``rank`` end; ``how`` completes "then it ...", e.g. "was
    killed by SIGKILL (process 4829)". A report waiting for final records stops waiting for this rank's,
    which a lost rank never writes (without this, the whole ``failure_report_wait_s``), and says how it
    ended. Lasts for the process: a rank number lost once is not reused in a run without fault tolerance."""
    with _LOST_NOTED:
        _LOST[rank] = how
        _LOST_NOTED.notify_all()


def peer_report(process_group: dist.ProcessGroup | None) -> str | None:
    """What the other ranks last did, for a communication error on ``process_group`` (``None``: unknown)."""
    group = process_group if process_group is not None else dist.group.WORLD
    board = _BOARDS.get(id(group))
    return board.report(board.final_grace_s) if board is not None else None


def _store_of(process_group: dist.ProcessGroup) -> dist.Store | None:
    """A private client of the group's store with a short timeout: a report must not wait for a dead link."""
    try:
        store = process_group_store(process_group)
    except Exception:  # noqa: BLE001 - private API; fall back to the default store
        try:
            store = default_store()
        except Exception:  # noqa: BLE001
            return None
    try:
        store = store.clone()
        store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - stores that cannot clone: use the shared client
        pass
    return store
