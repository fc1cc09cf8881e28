"""What a fault-tolerant run may be told: how long to wait, how few ranks to go on with.

One frozen dataclass, checked once when it is built, so that a wrong value fails before any process starts
(each message names the option). ``FaultToleranceOptions.of(value)`` accepts what users write: ``True``,
a dict of these options, or the dataclass itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from lightning_ddpx.engine.option_values import check_int, is_finite_number

__all__ = ["FaultToleranceOptions"]


@dataclass(frozen=True)
class FaultToleranceOptions:
    """Options of a fault-tolerant run (``fault_tolerance=True`` takes every default).

    Attributes:
        min_ranks: the run stops, on every rank, when fewer ranks than this are left.
        heartbeat_timeout_s: a rank whose heartbeat has not moved for this long is lost, also when no
            collective notices (a silent peer on another machine). Processes the launcher supervises are
            marked lost as soon as they exit.
        collective_timeout_s: the process groups' timeout: how long a collective waits for a peer that
            neither answers nor closes its connection.
        join_timeout_s: how long a process waits for the run to form (a joiner of a running run waits as
            long as one of its members is alive), and a new group for all of its members to arrive.
        replacements: how many replacement processes the strategies' launcher starts, one per process lost
            (the command-line launcher takes ``--replacements`` instead).
    """

    min_ranks: int = 1
    heartbeat_timeout_s: float = 10.0
    collective_timeout_s: float = 60.0
    join_timeout_s: float = 120.0
    replacements: int = 0

    def __post_init__(self) -> None:
        check_int("FaultToleranceOptions", "min_ranks", self.min_ranks, minimum=1)
        check_int("FaultToleranceOptions", "replacements", self.replacements, minimum=0)
        for name in ("heartbeat_timeout_s", "collective_timeout_s", "join_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not is_finite_number(value):
                raise TypeError(
                    f"FaultToleranceOptions: {name} must be a number of seconds, got {value!r} "
                    f"({type(value).__name__})."
                )
            if value <= 0:
                raise ValueError(f"FaultToleranceOptions: {name} must be > 0 seconds, got {value!r}.")

    @classmethod
    def of(cls, value: "bool | Mapping[str, Any] | FaultToleranceOptions") -> "FaultToleranceOptions | None":
        """``value`` as options: ``False``/``None`` -> ``None`` (off), ``True`` -> the defaults, a dict -> those
        options (an unknown key is named with the valid ones)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = [f.name for f in fields(cls)]
            unknown = sorted(str(key) for key in value if key not in known)
            if unknown:
                raise ValueError(f"fault_tolerance: unknown option(s) {unknown}; the options are {known}.")
            return cls(**dict(value))
        raise TypeError(
            "fault_tolerance must be True/False, a dict of FaultToleranceOptions' fields or a "
            f"FaultToleranceOptions, got {type(value).__name__}."
        )
