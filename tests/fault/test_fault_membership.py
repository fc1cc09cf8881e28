"""Fault tolerance's agreement through the store, in one process: generations, the step's vote, admission.

Each "member" is a thread with its own client of one TCPStore (as each training process has), so these run
in a second and need no process group; tests/fault/test_fault_tolerance.py runs the real thing across processes.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_ddpx.fault import FaultToleranceError, FaultToleranceOptions, Generation, RunEnded
from lightning_ddpx.fault.commit import ABORT, COMMIT, COMMIT_AND_ADMIT, vote
from lightning_ddpx.fault.membership import Membership

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )
    yield store
    del store


def client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20))


def membership(server, uid: str, **overrides) -> Membership:
    options = dict(heartbeat_timeout_s=0.5, join_timeout_s=5.0, min_ranks=1) | overrides
    return Membership(client(server), uid, **options)


def in_threads(*calls):
    """Run each call in its own thread; return their results (re-raising the first error)."""
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    return results


GEN1 = Generation(1, ("a", "b", "c"), (), 3, "start")


def test_a_generation_round_trips_through_json_and_knows_its_newcomers():
    record = Generation(3, ("a", "c", "d"), ("a", "c"), 4, "step 7 failed", ("b: killed by SIGKILL",))
    assert Generation.from_json(record.to_json()) == record
    assert record.rank_of("c") == 1 and record.newcomers == ("d",)


def test_every_member_voting_ok_commits_on_every_member(server):
    members = [membership(server, uid) for uid in GEN1.members]
    decisions = in_threads(*[lambda m=m: vote(m.store, m, GEN1, 1, ok=True) for m in members])
    assert decisions == [COMMIT] * 3


def test_one_failed_member_aborts_the_step_on_every_member(server):
    members = [membership(server, uid) for uid in GEN1.members]
    decisions = in_threads(
        *[lambda m=m, i=i: vote(m.store, m, GEN1, 1, ok=i != 1) for i, m in enumerate(members)]
    )
    assert decisions == [ABORT] * 3


def test_a_member_lost_before_voting_aborts_the_step_on_the_others(server):
    a, b = membership(server, "a"), membership(server, "b")
    server.set("ft/dead/c", "killed by SIGKILL")  # the launcher's mark: c exited after its collectives
    decisions = in_threads(
        lambda: vote(a.store, a, GEN1, 1, ok=True), lambda: vote(b.store, b, GEN1, 1, ok=True)
    )
    assert decisions == [ABORT, ABORT]


def test_a_silent_member_is_lost_when_its_heartbeat_stalls(server):
    a = membership(server, "a", heartbeat_timeout_s=0.3)
    assert a.lost_reason("c") is None  # first sight: the clock starts
    server.add("ft/heartbeat/c", 1)
    assert a.lost_reason("c") is None  # it moved
    decision = vote(a.store, a, Generation(1, ("a", "c"), (), 2, "start"), 1, ok=True)
    assert decision == ABORT
    assert "no heartbeat" in a.lost_reason("c")


def test_a_commit_says_when_newcomers_wait(server):
    a = membership(server, "a")
    b = membership(server, "b")
    b.register()  # a joiner beyond the generation's consumed entries
    assert vote(a.store, a, Generation(1, ("a",), (), 0, "start"), 1, ok=True) == COMMIT_AND_ADMIT


def test_the_first_generation_forms_when_the_initial_processes_registered(server):
    members = [membership(server, uid) for uid in ("p2", "p0", "p1")]
    for m in members:
        m.register()
    generations = in_threads(*[lambda m=m: m.wait_for_admission(3) for m in members])
    assert all(g == generations[0] for g in generations)
    assert generations[0].number == 1 and generations[0].members == ("p0", "p1", "p2")


def test_survivors_agree_on_the_next_generation_without_the_lost_member_and_with_the_joiner(server):
    a, b, joiner = membership(server, "a"), membership(server, "b"), membership(server, "d")
    for uid in ("a", "b", "c"):
        server.add("ft/joiner_count", 1)
        server.set(f"ft/joiner/{server.add('ft/joiner_count', 0)}", uid)
    joiner.register()
    server.set("ft/dead/c", "killed by SIGKILL")
    for uid in ("a", "b"):  # they hold the trained state
        server.set(f"ft/healthy/{uid}", "1")
    generations = in_threads(
        lambda: a.next_generation(GEN1, "step 4 failed"), lambda: b.next_generation(GEN1, "x")
    )
    assert generations[0] == generations[1]
    g = generations[0]
    assert g.number == 2 and g.members == ("a", "b", "d") and g.previous == ("a", "b")
    assert g.lost == ("c: killed by SIGKILL",) and g.newcomers == ("d",) and g.joiners_consumed == 4
    assert joiner.wait_for_admission(3) == g


def test_too_few_ranks_left_stops_the_run_by_name(server):
    a = membership(server, "a", min_ranks=2)
    a.mark_healthy()
    server.set("ft/dead/b", "exit code 1")
    server.set("ft/dead/c", "killed by SIGKILL")
    with pytest.raises(FaultToleranceError, match="only 1 rank.*min_ranks=2"):
        a.next_generation(GEN1, "step 3 failed")


def test_a_member_left_out_of_the_next_generation_stops(server):
    a = membership(server, "a")
    a.propose(Generation(2, ("b", "c"), ("b", "c"), 3, "step 3 failed", ("a: no heartbeat for 10.0 s",)))
    with pytest.raises(FaultToleranceError, match="process a was left out of generation 2"):
        a.next_generation(GEN1, "step 3 failed")


def test_a_joiner_arriving_after_the_run_ended_is_told_so(server):
    a, late = membership(server, "a"), membership(server, "z")
    a.propose(Generation(1, ("a",), (), 1, "start"))
    a.leave(Generation(1, ("a",), (), 1, "start"))
    late.register()
    with pytest.raises(RunEnded, match="the run ended"):
        late.wait_for_admission(1)


def test_a_joiner_waits_past_join_timeout_while_the_run_trains_and_stops_when_its_members_are_gone(server):
    a, late = membership(server, "a"), membership(server, "z", join_timeout_s=0.3, heartbeat_timeout_s=0.5)
    a.propose(Generation(1, ("a",), (), 1, "start"))
    late.register()
    beating = threading.Event()

    def heartbeat():  # member a trains: its heartbeat moves for 2 s, then it is gone
        store = client(server)
        for _ in range(40):
            store.add("ft/heartbeat/a", 1)
            time.sleep(0.05)
        beating.set()

    thread = threading.Thread(target=heartbeat)
    thread.start()
    started = time.monotonic()
    with pytest.raises(FaultToleranceError, match="every member of generation 1 was lost before process z"):
        late.wait_for_admission(1)
    waited = time.monotonic() - started
    thread.join()
    assert beating.is_set() and waited >= 2.0, waited  # waited while a lived, far past join_timeout_s
    assert waited < 2.0 + 0.5 + 1.5, waited  # and stopped once a's heartbeat stalled, not a timeout later


def test_a_joiner_not_admitted_in_time_is_told_why(server):
    late = membership(server, "z", join_timeout_s=0.3, min_ranks=2)  # alone: never enough to start
    late.register()
    with pytest.raises(FaultToleranceError, match="not admitted into the run within join_timeout_s=0.3"):
        late.wait_for_admission(5)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ({"min_ranks": 0}, ValueError, "min_ranks"),
        ({"min_ranks": 1.5}, TypeError, "min_ranks"),
        ({"heartbeat_timeout_s": "10"}, TypeError, "heartbeat_timeout_s must be a number"),
        ({"join_timeout_s": 0}, ValueError, "join_timeout_s must be > 0"),
        ({"replacement": 1}, ValueError, r"unknown option\(s\) \['replacement'\]; the options are"),
        ("yes", TypeError, "fault_tolerance must be True/False"),
    ],
)
def test_options_are_checked_by_name(value, error, match):
    with pytest.raises(error, match=match):
        FaultToleranceOptions.of(value)


def test_options_from_what_users_write():
    assert FaultToleranceOptions.of(False) is None and FaultToleranceOptions.of(None) is None
    assert FaultToleranceOptions.of(True) == FaultToleranceOptions()
    assert FaultToleranceOptions.of({"min_ranks": 2}).min_ranks == 2


def test_a_newcomer_whose_healing_was_cut_short_is_a_newcomer_again(server):
    a, d = membership(server, "a"), membership(server, "d")
    a.mark_healthy()  # d was admitted in generation 2 but never healed: b died while it was being healed
    gen2 = Generation(2, ("a", "b", "d"), ("a", "b"), 4, "newcomers waiting")
    server.set("ft/dead/b", "killed by SIGKILL")
    g3 = in_threads(lambda: a.next_generation(gen2, "x"), lambda: d.next_generation(gen2, "x"))[0]
    assert g3.members == ("a", "d") and g3.previous == ("a",) and g3.newcomers == ("d",)


def test_no_member_holding_the_trained_state_left_stops_the_run_by_name(server):
    d = membership(server, "d")
    gen2 = Generation(2, ("a", "d"), ("a",), 2, "newcomers waiting")
    server.set("ft/dead/a", "killed by SIGKILL")
    with pytest.raises(
        FaultToleranceError, match="no member holding the trained state is left in generation 3"
    ):
        d.next_generation(gen2, "step 9 failed")


def test_an_agreement_is_the_first_proposal_on_every_member_and_numbered_per_generation(server):
    """Two members reached different decisions (one got every member's answer, the other only its own):
    both read the first one proposed, for each agreement of the generation; the next generation starts
    its numbering afresh."""
    a, b = membership(server, "a"), membership(server, "b")
    first = Generation(1, ("a", "b"), (), 2, "start")
    assert a.agree(first, 1, "1") == "1" and b.agree(first, 1, "0") == "1"  # a's came first
    assert b.agree(first, 2, "0") == "0" and a.agree(first, 2, "1") == "0"  # b's came first
    second = Generation(2, ("a", "b"), ("a", "b"), 2, "step failed")
    assert b.agree(second, 1, "0") == "0" and a.agree(second, 1, "1") == "0"


def test_a_member_alive_but_not_voting_aborts_the_step_after_the_wait_chosen(server):
    """c is alive (nobody's heartbeat stalls within heartbeat_timeout_s=30) but never votes (stuck outside
    the step): a and b abort the step after ``wait_s`` instead of waiting forever."""
    a, b = (membership(server, uid, heartbeat_timeout_s=30.0) for uid in ("a", "b"))
    started = time.monotonic()
    decisions = in_threads(
        lambda: vote(a.store, a, GEN1, 1, ok=True, wait_s=1.0),
        lambda: vote(b.store, b, GEN1, 1, ok=True, wait_s=1.0),
    )
    assert decisions == [ABORT, ABORT]
    assert 1.0 <= time.monotonic() - started < 5.0
    assert a.lost_reason("c") is None  # not lost: only silent


def test_a_member_alive_but_not_coming_back_is_left_behind_after_join_timeout(server):
    """c is alive but does not come to the next generation: after ``join_timeout_s`` a and b form it without
    c, saying why; c, coming back later, learns that it was left out."""
    a, b = (membership(server, uid, heartbeat_timeout_s=30.0, join_timeout_s=1.0) for uid in ("a", "b"))
    a.mark_healthy()
    b.mark_healthy()
    started = time.monotonic()
    ga, gb = in_threads(
        lambda: a.next_generation(GEN1, "step 3 failed"), lambda: b.next_generation(GEN1, "step 3 failed")
    )
    assert 1.0 <= time.monotonic() - started < 5.0
    assert ga == gb and ga.members == ("a", "b") and ga.previous == ("a", "b")
    assert ga.lost == ("c: did not come back within join_timeout_s=1 s",)
    with pytest.raises(FaultToleranceError, match="process c was left out of generation 2"):
        membership(server, "c").next_generation(GEN1, "step 3 failed")
