"""Which round of a restarting launcher this process belongs to, for keys in a store that outlives a round.

torchrun (torch >= 2.5) hands every round of workers the same TCP store, the agent's, and counts its
restarts in ``TORCHELASTIC_RESTART_COUNT``. A key written by a killed round is still there when the next
round starts: a key name without the round would give the new round the old round's value (a dead rank's
address, a stale progress record). Every key lightning_ddpx writes to such a store carries the round
(:func:`round_prefix`); a process of an old round then never reads, or completes, a new round's handshake.
Without torchrun the round is ``0``.
"""

from __future__ import annotations

import os

__all__ = ["ROUND_ENV", "launch_round", "round_prefix"]

ROUND_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's agent for every worker of a round


def launch_round() -> int:
    """This process's restart round: torchrun's restart count, or 0."""
    value = os.environ.get(ROUND_ENV, "").strip()
    return int(value) if value.isdigit() else 0


def round_prefix(what: str) -> str:
    """The store prefix of ``what`` in this round, ending in ``/``: ``lightning_ddpx/round<N>/<what>/``."""
    return f"lightning_ddpx/round{launch_round()}/{what}/"
