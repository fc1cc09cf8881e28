"""Whether a step counts: every member's collectives succeeded, agreed through the store before any rank
applies the step.

A rank dying mid-step can leave the survivors in different states: one finished its last all-reduce, another
failed in it. Whatever each saw, all must do the same with the step, so each member votes and one decision
is written, once, by ``compare_set`` (the first writer wins, everyone reads the same):

- a member whose collectives failed writes ``abort`` at once;
- the member whose ``ok`` vote completes the count writes ``commit`` (``commit+admit`` when newcomers wait
  in the joiner log: the members admit them at the next step boundary);
- a member waiting for the decision looks, every ``POLL_S``, for a lost member (the launcher's mark, a
  stalled heartbeat) or one already waiting for the next generation (a failure between steps that only it
  saw), and writes ``abort`` if it finds one: a rank that died after its collectives but before voting;
- a member that has waited ``wait_s`` (the collective timeout) writes ``abort`` too: a member alive but
  stuck before its vote (its heartbeat still moving: a hung data loader, a blocked file system) must not
  hold the others forever, as it would not in a collective. The regroup then leaves it behind if it does
  not come back within ``join_timeout_s``.

A commit therefore means every member's vote was ``ok``: no rank applies a half-reduced update.

What it costs, on the critical path of every step: the last voter's ``add`` and ``compare_set`` (whether
newcomers wait is read from the heartbeat thread's last look, not from the store), the store telling the
waiting members, and their read of the decision: one ``compare_set`` that changes nothing (``get`` would be
two round trips: it waits for the key first).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from lightning_ddpx.fault.membership import Generation, Membership

__all__ = ["ABORT", "COMMIT", "COMMIT_AND_ADMIT", "vote"]

COMMIT, COMMIT_AND_ADMIT, ABORT = "commit", "commit+admit", "abort"
POLL_S = 0.25  # how often a waiting member looks for a lost one
CHECK_S = 0.005  # how often it looks for the decision, once the first wait is over
_NEVER_WRITTEN = "\x00lightning_ddpx: never written"  # compare_set with it reads a key, changing nothing


def vote(
    store: Any,
    membership: Membership,
    generation: Generation,
    attempt: int,
    ok: bool,
    wait_s: float | None = None,
) -> str:
    """This member's vote on step ``attempt`` of ``generation`` (attempts are numbered per generation, so a
    retried step votes afresh); returns the decision every member reads. ``wait_s``: after waiting that
    long for the others, abort (``None``: wait as long as every member is alive)."""
    prefix = f"ft/gen/{generation.number}/step/{attempt}/"
    decision_key = prefix + "decision"
    if ok:
        if int(store.add(prefix + "ok", 1)) == len(generation.members):
            admit = membership.joiners_seen() > generation.joiners_consumed
            return store.compare_set(decision_key, "", COMMIT_AND_ADMIT if admit else COMMIT).decode()
    else:
        return store.compare_set(decision_key, "", ABORT).decode()
    started = looked = time.monotonic()
    try:
        store.wait([decision_key], timedelta(seconds=POLL_S))  # most votes are decided by then
        return _read(store, decision_key)
    except RuntimeError:  # not decided yet: a member may have died before voting
        pass
    while True:  # polled without the store's blocking wait, which logs a warning at each timeout
        if store.check([decision_key]):
            return _read(store, decision_key)
        now = time.monotonic()
        if now - looked >= POLL_S:
            looked = now
            lost = membership.any_lost(generation.members) or membership.moved_on(generation)
            if lost is not None or (wait_s is not None and now - started > wait_s):
                return store.compare_set(decision_key, "", ABORT).decode()
        time.sleep(CHECK_S)


def _read(store: Any, key: str) -> str:
    """The value of ``key``, which exists, in one store round trip: a ``compare_set`` expecting a value
    never written returns the value there and changes nothing."""
    value = store.compare_set(key, _NEVER_WRITTEN, _NEVER_WRITTEN).decode()
    if value == _NEVER_WRITTEN:
        raise RuntimeError(f"lightning_ddpx fault tolerance: the store lost the decision {key!r}")
    return value
