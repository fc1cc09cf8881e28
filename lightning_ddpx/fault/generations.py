"""The run's generations as one training process sees them: the current one and its default process group.

A generation is a membership agreed through the launcher's store
(:class:`~lightning_ddpx.fault.membership.Membership`); each gets a new default process group on that store
(``ft/gen/<n>/pg/``, rank = place in its member list). Votes and agreements are keyed by the generation and
by a count that restarts with each one (:attr:`Generations.attempt`, :attr:`Generations.agreements`).
"""

from __future__ import annotations

import gc
import logging
import weakref
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import is_communication_failure
from lightning_ddpx.fault.launch_env import LaunchInfo, connect
from lightning_ddpx.fault.membership import Generation, Membership
from lightning_ddpx.fault.options import FaultToleranceOptions
from lightning_ddpx.fault.stats import FaultToleranceStats

__all__ = ["Generations"]

log = logging.getLogger("lightning_ddpx.fault")


class Generations:
    """The store, the membership and the current generation's group of one training process."""

    def __init__(
        self,
        options: FaultToleranceOptions,
        launch: LaunchInfo,
        backend: str,
        stats: FaultToleranceStats,
        note: Callable[[str], None],
    ) -> None:
        self.options, self.launch, self.backend, self.uid = options, launch, backend, launch.uid
        self._stats, self._note = stats, note
        timeout = timedelta(seconds=options.join_timeout_s)
        self.store = connect(launch, timeout)
        self.membership = Membership(
            self.store,
            self.uid,
            heartbeat_timeout_s=options.heartbeat_timeout_s,
            join_timeout_s=options.join_timeout_s,
            min_ranks=options.min_ranks,
            connect=lambda: connect(launch, timeout),
        )
        self.listeners: list[Callable[[Generation], None]] = []  # told of each new generation
        self.attempt = 0  # step attempts in this generation (the vote's key)
        self.agreements = 0  # agree() calls in this generation (the agreements' keys)
        self.current: Generation
        self._group: weakref.ref[dist.ProcessGroup] | None = None  # the current group, to see it freed

    def join(self) -> None:
        """Register, wait to be admitted to the run, and build the first group."""
        self.membership.register()
        self.enter(self.membership.wait_for_admission(self.launch.initial_world_size))

    @property
    def rank(self) -> int:
        return self.current.rank_of(self.uid)

    def enter(self, generation: Generation) -> None:
        """Build the default process group of ``generation`` (rank = place in its member list)."""
        self._destroy_group()
        self.current = generation
        self.attempt = 0
        self.agreements = 0
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"ft/gen/{generation.number}/pg/", self.store),
            rank=generation.rank_of(self.uid),
            world_size=len(generation.members),
            timeout=timedelta(seconds=self.options.collective_timeout_s),
        )
        self._group = weakref.ref(dist.group.WORLD)
        stats = self._stats
        stats.generation, stats.world_size = generation.number, len(generation.members)
        stats.members_lost += len(generation.lost)
        lost = f"; lost {', '.join(generation.lost)}" if generation.lost else ""
        joined = [uid for uid in generation.newcomers if generation.number > 1]
        admitted = f"; admitted {', '.join(joined)}" if joined else ""
        self._note(
            f"generation {generation.number}: {len(generation.members)} rank(s) {list(generation.members)} "
            f"({generation.reason}{lost}{admitted}); this process is rank {generation.rank_of(self.uid)}"
        )
        for listener in self.listeners:
            listener(generation)

    def next(self, reason: str, admit: bool) -> Generation:
        """Agree on the next generation (with the waiting newcomers if ``admit``) and build its group; a
        member of the record that does not arrive was lost meanwhile, and makes another one."""
        current = self.current
        while True:
            generation = self.membership.next_generation(current, reason, admit_joiners=admit)
            try:
                self.enter(generation)
                return generation
            except RuntimeError as error:  # a member of the record did not arrive: it was lost meanwhile
                if not is_communication_failure(error) and "timeout" not in str(error).lower():
                    raise
                current, reason = generation, f"a member of generation {generation.number} did not arrive"

    def release(self) -> None:
        """Destroy the current group now that this member's step failed: in a ring all-reduce a survivor may
        be waiting for data from another survivor that has already left the step; once the group's last
        reference is gone its connections close, and that receive fails at once instead of after the
        collective timeout (``ProcessGroup.abort()`` does not close gloo's). Rebuilt by :meth:`next`. The
        caller has let go of its own references first (the module's)."""
        self._destroy_group()

    def _destroy_group(self) -> None:
        """Destroy the current group; its connections close once nothing holds it. Note [the failed group's
        last reference]: what held it after a failure were cycles -- the closed reducer's readiness closures
        (broken in ``Reducer.close``) and the failed step's traceback frames (dropped by
        :func:`~lightning_ddpx.fault.steps.forget_frames`) -- so it is freed by reference counting here. A full
        collection (0.1-0.5 s with a training process's ~290k objects, on the critical path of every
        recovery) runs only if something still holds it: met only when a member's own collective failed
        while its peers' succeeded (tests/jobs/fault_job.py's ``collective`` injection: the old reducer stays
        reachable from a cycle through the raised error), where no peer is blocked on it."""
        if not dist.is_initialized():
            return
        dist.destroy_process_group()
        if self._group is not None and self._group() is not None:
            log.debug("lightning_ddpx fault tolerance: the destroyed group is still held; collecting cycles")
            gc.collect()
        self._group = None

    def agree(self, value: str) -> str:
        """The first member's ``value`` for the next agreement of this generation."""
        self.agreements += 1
        return self.membership.agree(self.current, self.agreements, value)

    def close(self) -> None:
        self.membership.leave(self.current)
        self.membership.close()
