"""Who is in the run: generations of members agreed through a store that outlives every training process.

A *generation* is one membership: its number, its members (process uids, sorted: a member's rank is its
place in the list), the members that were also in the generation before (the live peers a newcomer heals
from), and why it formed. It is written once, under ``ft/gen/<n>/members``, by whichever process proposes it
first (``compare_set``: the first proposal wins, every process adopts the same one).

- **Admission.** A process registers in the joiner log (``ft/joiner_count``, ``ft/joiner/<i>``). The first
  generation forms when the launcher's initial world size has registered (or, after ``join_timeout_s``, with
  at least ``min_ranks``). Later joiners are admitted by the members at a step boundary.
- **Loss.** A member is lost when the launcher marked it (``ft/dead/<uid>``: it exited), or when its
  heartbeat (a counter under ``ft/heartbeat/<uid>``, moved every ``timeout / 5`` s by a thread) has not
  moved for ``heartbeat_timeout_s`` as seen by this process's clock (no clocks are compared across machines).
- **The next generation.** After a failed step, each surviving member says it is present
  (``ft/gen/<n+1>/present/<uid>``); the proposer waits until every member of the old generation is present
  or lost, adds the joiners that registered meanwhile, and proposes. Its live peers (``previous``) are the
  survivors that hold the trained state (``ft/healthy/<uid>``: there from the start, or healed and
  verified); a newcomer whose healing was cut short by another loss is a newcomer again. A member left out (it was thought lost)
  learns it from the record and stops with :class:`FaultToleranceError`.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

__all__ = ["FaultToleranceError", "Generation", "Membership", "RunEnded"]

JOINER_LOOK_S = 0.2  # how often the heartbeat thread reads the joiner log's length

POLL_S = 0.02  # how often a waiting process looks at the store again


class FaultToleranceError(RuntimeError):
    """The run cannot go on fault-tolerantly: too few ranks left, this process was left out, or a process
    was not admitted in time. The message says which, and what to do."""


class RunEnded(FaultToleranceError):
    """This process was not admitted because the run ended first (a replacement that arrived after the last
    step): nothing is left to do, and the process may exit with code 0."""


@dataclass(frozen=True)
class Generation:
    """One membership of the run, as every member adopted it."""

    number: int
    members: tuple[str, ...]  # process uids, sorted: rank = index
    previous: tuple[str, ...]  # members that were also in the generation before (the live peers)
    joiners_consumed: int  # joiner-log entries admitted so far
    reason: str  # why it formed, for logs
    lost: tuple[str, ...] = ()  # members of the generation before that it leaves out, "uid: reason"

    def rank_of(self, uid: str) -> int:
        return self.members.index(uid)

    @property
    def newcomers(self) -> tuple[str, ...]:
        return tuple(uid for uid in self.members if uid not in self.previous)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Generation":
        data = json.loads(text)
        return cls(**{key: tuple(value) if isinstance(value, list) else value for key, value in data.items()})


class _Heartbeat:
    """A daemon thread on its own store connection (a store client is not shared between threads): moves
    this process's heartbeat counter every ``interval_s``, and reads the joiner log's length every
    ``JOINER_LOOK_S``, so that the member completing a step's vote decides on admission without a store
    round trip of its own (:meth:`Membership.joiners_seen`)."""

    def __init__(self, connect: Callable[[], Any], uid: str, interval_s: float) -> None:
        self._stop = threading.Event()
        self.joiners: int | None = None  # the joiner log's length when last read; None before the first read
        self._thread = threading.Thread(
            target=self._run, args=(connect, uid, interval_s), name="lightning_ddpx-ft-heartbeat", daemon=True
        )
        self._thread.start()

    def _run(self, connect: Callable[[], Any], uid: str, interval_s: float) -> None:
        try:
            store = connect()
            beat_due = time.monotonic()
            while not self._stop.is_set():
                if time.monotonic() >= beat_due:
                    store.add(f"ft/heartbeat/{uid}", 1)
                    beat_due = time.monotonic() + interval_s
                self.joiners = int(store.add("ft/joiner_count", 0))
                self._stop.wait(min(JOINER_LOOK_S, max(0.0, beat_due - time.monotonic())))
        except Exception:  # noqa: BLE001 - the store is gone: the run is over, the main thread will say so
            return

    def stop(self) -> None:
        self._stop.set()


class Membership:
    """This process's view of the run's membership, through ``store`` (a client of the launcher's store)."""

    def __init__(
        self,
        store: Any,
        uid: str,
        *,
        heartbeat_timeout_s: float,
        join_timeout_s: float,
        min_ranks: int,
        connect: Callable[[], Any] | None = None,
    ) -> None:
        self.store, self.uid = store, uid
        self.heartbeat_timeout_s, self.join_timeout_s, self.min_ranks = (
            heartbeat_timeout_s,
            join_timeout_s,
            min_ranks,
        )
        self._seen: dict[str, tuple[int, float]] = {}  # uid -> (heartbeat count, when it last moved here)
        self._heartbeat = _Heartbeat(connect, uid, heartbeat_timeout_s / 5) if connect is not None else None

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()

    # ------------------------------------------------------------------------------------------ loss
    def lost_reason(self, uid: str) -> str | None:
        """Why member ``uid`` is lost, or ``None`` while it looks alive."""
        store = self.store
        if store.check([f"ft/dead/{uid}"]):
            return store.get(f"ft/dead/{uid}").decode()
        count = int(store.add(f"ft/heartbeat/{uid}", 0))
        now = time.monotonic()
        last_count, since = self._seen.get(uid, (-1, now))
        if count != last_count:
            self._seen[uid] = (count, now)
            return None
        if now - since > self.heartbeat_timeout_s:
            return f"no heartbeat for {now - since:.1f} s"
        return None

    def any_lost(self, members: Sequence[str]) -> str | None:
        """``"uid: reason"`` of the first lost member other than this process, or ``None``."""
        for uid in members:
            if uid != self.uid:
                reason = self.lost_reason(uid)
                if reason is not None:
                    return f"{uid}: {reason}"
        return None

    # ------------------------------------------------------------------------------------- admission
    def register(self) -> None:
        """Enter the joiner log: the members admit this process at their next step boundary."""
        index = int(self.store.add("ft/joiner_count", 1))
        self.store.set(f"ft/joiner/{index}", self.uid)

    def joiners_after(self, consumed: int) -> tuple[list[str], int]:
        """Joiners registered after the first ``consumed`` entries of the log (alive ones only), and how many
        entries that read (a lost joiner's entry is consumed too)."""
        count = int(self.store.add("ft/joiner_count", 0))
        uids = [self.store.get(f"ft/joiner/{i}").decode() for i in range(consumed + 1, count + 1)]
        return [uid for uid in uids if self.lost_reason(uid) is None], count

    def moved_on(self, generation: Generation) -> str | None:
        """A member of ``generation`` already waiting for the next one (it saw a failure this process did
        not), or ``None``: whatever it would vote, the step cannot commit."""
        for uid in generation.members:
            if uid != self.uid and self.store.check([f"ft/gen/{generation.number + 1}/present/{uid}"]):
                return uid
        return None

    def joiner_count(self) -> int:
        return int(self.store.add("ft/joiner_count", 0))

    def joiners_seen(self) -> int:
        """The joiner log's length as the heartbeat thread last read it (at most ``JOINER_LOOK_S`` ago; read
        now when there is no such thread). Possibly short of the latest: a joiner registered since is
        admitted a step later. The vote uses it off the store's critical path."""
        seen = self._heartbeat.joiners if self._heartbeat is not None else None
        return seen if seen is not None else self.joiner_count()

    def agree(self, generation: Generation, index: int, value: str) -> str:
        """The value every member of ``generation`` reads for its ``index``-th agreement, whatever each
        proposes: the first proposal written (``compare_set``). For a decision between steps that a failed
        collective may have left different on different members (one got every member's answer, another
        only its own): read through the store, it is one answer on every member."""
        key = f"ft/gen/{generation.number}/agree/{index}"
        return self.store.compare_set(key, "", value).decode()

    def leave(self, generation: Generation) -> None:
        """This member leaves the run (its training ended): counted, so that a joiner waiting for admission
        learns when every member has left."""
        self.store.add(f"ft/gen/{generation.number}/closed", 1)

    def mark_healthy(self) -> None:
        """This process holds the run's trained state (healed and verified, or there from the start)."""
        self.store.set(f"ft/healthy/{self.uid}", "1")

    def healthy(self, uid: str) -> bool:
        return self.store.check([f"ft/healthy/{uid}"])

    def closed(self, generation: Generation) -> bool:
        return int(self.store.add(f"ft/gen/{generation.number}/closed", 0)) >= len(generation.members)

    def record(self, number: int) -> Generation | None:
        key = f"ft/gen/{number}/members"
        return Generation.from_json(self.store.get(key)) if self.store.check([key]) else None

    def latest(self) -> int:
        key = "ft/latest_gen"
        return int(self.store.get(key).decode()) if self.store.check([key]) else 0

    def propose(self, generation: Generation) -> Generation:
        """Write ``generation`` unless another process proposed that number first; returns the winner."""
        key = f"ft/gen/{generation.number}/members"
        winner = Generation.from_json(self.store.compare_set(key, "", generation.to_json()))
        self._advance_latest(winner.number)
        return winner

    def _advance_latest(self, number: int) -> None:
        """Raise ``ft/latest_gen`` (where joiners look) to ``number``; it never goes down."""
        key = "ft/latest_gen"
        while True:
            current = self.store.get(key).decode() if self.store.check([key]) else ""
            if current and int(current) >= number:
                return
            if self.store.compare_set(key, current, str(number)).decode() == str(number):
                return

    def wait_for_admission(self, initial_world_size: int) -> Generation:
        """Block until a generation with this process forms (the first one, or one the members propose at a
        step boundary); raise :class:`FaultToleranceError` after ``join_timeout_s`` without progress. While
        the run trains (a member of its latest generation is alive), a joiner keeps waiting: the Trainer
        strategy admits newcomers at an epoch's start only, which may be longer away than that."""
        started = time.monotonic()
        while True:
            latest = self.latest()
            if latest:
                record = self.record(latest)
                if record is not None and self.uid in record.members:
                    return record
                if record is not None and self.closed(record):
                    raise RunEnded(
                        f"lightning_ddpx fault tolerance: the run ended (every member of generation {latest} "
                        f"closed) before process {self.uid} was admitted; nothing is left to do."
                    )
            else:
                first = self._maybe_propose_first(initial_world_size, time.monotonic() - started)
                if first is not None and self.uid in first.members:
                    return first
            if latest and not self._any_member_alive(latest):
                raise FaultToleranceError(
                    f"lightning_ddpx fault tolerance: every member of generation {latest} was lost before "
                    f"process {self.uid} was admitted: no live peer is left to heal it from (their logs say "
                    "why they ended)."
                )
            if time.monotonic() - started > self.join_timeout_s:
                if latest and self._any_member_alive(latest):
                    started = time.monotonic()  # the run is training: its next admission will come
                    continue
                raise FaultToleranceError(
                    f"lightning_ddpx fault tolerance: process {self.uid} was not admitted into the run within "
                    f"join_timeout_s={self.join_timeout_s:g} s (latest generation: {latest or 'none'}). The "
                    "run did not start, or none of its members is alive any more."
                )
            time.sleep(POLL_S)

    def _any_member_alive(self, number: int) -> bool:
        record = self.record(number)
        return record is not None and any(self.lost_reason(uid) is None for uid in record.members)

    def _maybe_propose_first(self, initial: int, waited_s: float) -> Generation | None:
        count = self.joiner_count()
        enough = count >= initial or (waited_s > self.join_timeout_s / 2 and count >= self.min_ranks)
        if not enough:
            return None
        uids = [self.store.get(f"ft/joiner/{i}").decode() for i in range(1, min(count, initial) + 1)]
        first = Generation(1, tuple(sorted(uids)), (), min(count, initial), "start")
        return self.propose(first)

    # --------------------------------------------------------------------------- the next generation
    def next_generation(self, current: Generation, reason: str, admit_joiners: bool = True) -> Generation:
        """The generation after ``current``, as every surviving member adopts it (see the module's
        docstring). Collective through the store among ``current``'s surviving members. With
        ``admit_joiners=False`` the joiners keep waiting (whoever proposes first decides for everyone)."""
        number = current.number + 1
        self.store.set(f"ft/gen/{number}/present/{self.uid}", "1")
        existing = self.record(number)
        if existing is None:
            survivors, lost = self._survivors(current, number)
            joiners, consumed = (
                self.joiners_after(current.joiners_consumed)
                if admit_joiners
                else ([], current.joiners_consumed)
            )
            members = tuple(sorted(set(survivors) | set(joiners)))
            # the live peers: survivors holding the trained state (a newcomer whose healing was cut short is
            # a newcomer again)
            peers = tuple(uid for uid in survivors if self.healthy(uid))
            proposal = Generation(number, members, peers, consumed, reason, tuple(lost))
            existing = self.propose(proposal)
        if self.uid not in existing.members:
            raise FaultToleranceError(
                f"lightning_ddpx fault tolerance: process {self.uid} was left out of generation {number} (the "
                "others thought it lost: its heartbeat stalled for heartbeat_timeout_s, or it did not come back "
                "to a step within collective_timeout_s and then join_timeout_s). It stops; the launcher may "
                "start a replacement."
            )
        if not existing.previous:
            raise FaultToleranceError(
                f"lightning_ddpx fault tolerance: no member holding the trained state is left in generation "
                f"{number} ({', '.join(existing.lost) or 'none lost'}); the newcomers cannot be healed and the "
                "run stops on every rank."
            )
        if len(existing.members) < self.min_ranks:
            raise FaultToleranceError(
                f"lightning_ddpx fault tolerance: only {len(existing.members)} rank(s) left in generation "
                f"{number} ({', '.join(existing.lost) or 'none lost'}), fewer than min_ranks={self.min_ranks}: "
                "the run stops on every rank."
            )
        return existing

    def _survivors(self, current: Generation, number: int) -> tuple[list[str], list[str]]:
        """Wait until every member of ``current`` is present for ``number`` or lost; returns both lists. A
        member still alive (its heartbeat moving) that has not come back after ``join_timeout_s`` (stuck
        outside the steps: a hung data loader) is left behind as lost; if it comes back later it learns that
        it was left out, and stops."""
        started = time.monotonic()
        while True:
            present, lost, missing = [], [], []
            for uid in current.members:
                if uid == self.uid or self.store.check([f"ft/gen/{number}/present/{uid}"]):
                    present.append(uid)
                    continue
                reason = self.lost_reason(uid)
                if reason is not None:
                    lost.append(f"{uid}: {reason}")
                else:
                    missing.append(uid)
            if not missing:
                return present, lost
            if self.record(number) is not None:  # another member proposed meanwhile: adopt its record
                winner = self.record(number)
                assert winner is not None
                return list(winner.previous), list(winner.lost)
            if time.monotonic() - started > self.join_timeout_s:  # alive (a heartbeat) but not coming back
                lost += [
                    f"{uid}: did not come back within join_timeout_s={self.join_timeout_s:g} s"
                    for uid in missing
                ]
                return present, lost
            time.sleep(POLL_S)
