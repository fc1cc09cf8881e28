"""The strategy options fault tolerance cannot follow, refused by name when a strategy is built.

Its own module so that :mod:`lightning_ddpx.lightning.settings.config` (which calls it while it checks the options)
imports nothing that imports it back.
"""

from __future__ import annotations

from typing import Any

from lightning_ddpx.fault.checks import check_post_local_sgd_options, refuse_unsupported_hook

__all__ = ["check_options"]


def check_options(config: Any) -> None:
    """Refuse, by name, what cannot survive a membership change in ``config`` (a ``DDPXConfig``), when the
    strategy is built."""
    hook = config.comm_hook
    refuse_unsupported_hook(hook)
    if hook == "post_local_sgd" and config.post_local_sgd is not None:
        options = config.post_local_sgd
        check_post_local_sgd_options(options.subgroup, options.hierarchy, options.period)
    for name, refused in (
        ("overlap_optimizer", config.overlap_optimizer),
        ("comm_state", config.comm_state is not None),
    ):
        if refused:
            raise ValueError(
                f"DDPXStrategy: fault_tolerance cannot be combined with {name} (it updates or averages "
                "parameters outside the step the members agree on)."
            )
    if config.uneven_inputs == "error":
        raise ValueError(
            "DDPXStrategy: fault_tolerance cannot be combined with uneven_inputs='error': every rank's "
            "training loader is sharded by the membership (equal lengths), and a changed membership reshards it."
        )
