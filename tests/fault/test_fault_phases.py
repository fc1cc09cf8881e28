"""A fault-tolerant member's phases (lightning_ddpx/fault/phases.py): the moves the step protocol makes are
allowed, the others raise at once, and a regroup, only a regroup, carries its reason."""

from __future__ import annotations

import pytest

from lightning_ddpx.fault import checks
from lightning_ddpx.fault.phases import MemberPhase, Phases
from lightning_ddpx.lightning.fault_tolerance import runs

H, V, R, S, T = (
    MemberPhase.HEAL_DUE,
    MemberPhase.VERIFY_DUE,
    MemberPhase.REGROUP_DUE,
    MemberPhase.IN_SYNC,
    MemberPhase.STEPPING,
)


def _at(phase: MemberPhase) -> Phases:
    phases = Phases()
    route = {H: [], V: [V], R: [R], S: [S], T: [S, T]}[phase]
    for step in route:
        phases.move(step, "why" if step is R else None)
    assert phases.current is phase
    return phases


def test_a_run_starts_with_a_heal_due() -> None:
    phases = Phases()
    assert phases.current is H and phases.heal_due and not phases.regroup_due
    assert phases.reason is None and not phases.admission_waiting


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (H, V),  # the first generation's replicas were made equal by the construction
        (H, S),  # healed
        (V, S),  # verified
        (H, R),  # a member was lost during the heal
        (R, H),  # regrouped with newcomers
        (R, S),  # regrouped without
        (S, T),  # a step begins
        (T, S),  # a step ends
        (T, R),  # an error of the user's inside a step
        (S, H),  # an admission
        (S, R),  # a collective between steps failed
    ],
)
def test_the_protocols_moves_are_allowed(start: MemberPhase, to: MemberPhase) -> None:
    phases = _at(start)
    phases.move(to, "why" if to is R else None)
    assert phases.current is to
    assert phases.reason == ("why" if to is R else None)


@pytest.mark.parametrize(
    ("start", "to"),
    [(T, T), (H, T), (V, T), (R, T), (T, H), (S, V), (R, V)],
    ids=[
        "step-in-step",
        "step-before-heal",
        "step-before-verify",
        "step-before-regroup",
        "heal-in-step",
        "verify-in-sync",
        "verify-after-regroup",
    ],
)
def test_other_moves_raise(start: MemberPhase, to: MemberPhase) -> None:
    phases = _at(start)
    with pytest.raises(RuntimeError, match=f"no move from '{start.value}' to '{to.value}'"):
        phases.move(to, "why" if to is R else None)
    assert phases.current is start


def test_only_a_regroup_has_a_reason() -> None:
    phases = _at(S)
    with pytest.raises(ValueError, match="only a regroup, has a reason"):
        phases.move(R)
    with pytest.raises(ValueError, match="only a regroup, has a reason"):
        phases.move(T, "why")
    phases.move(R, "step 3 failed")
    assert phases.regroup_due and phases.reason == "step 3 failed"
    phases.move(S)
    assert phases.reason is None


@pytest.mark.parametrize(
    ("check", "named"),
    [
        (
            lambda backend: checks.check_backend(backend),
            "FaultTolerance: fault_tolerance needs the gloo backend (backend='gloo')",
        ),
        (
            lambda backend: runs.check_backend(backend),
            "DDPXStrategy: fault_tolerance needs the gloo backend (process_group_backend='gloo')",
        ),
    ],
    ids=["bare-module", "strategies"],
)
def test_the_gloo_rule_is_one_and_names_each_callers_option(check, named) -> None:
    """One rule refuses a backend whose groups cannot be rebuilt; the bare module and the strategies each
    name their own option in it."""
    check("gloo")
    with pytest.raises(ValueError) as raised:
        check("nccl")
    assert str(raised.value).startswith(named) and "got 'nccl'" in str(raised.value)
