"""``verify_replicas_every_n_steps``: the strategies compare the ranks' weights every N optimizer steps and
before each checkpoint is written.

The engine does the comparison (:meth:`lightning_ddpx.DistributedDataParallel.verify_replicas`: a bitwise
digest per parameter, one ``all_gather`` of a few integers); this module decides when. Every rank runs the
same optimizer steps and saves the same checkpoints (Lightning and Fabric call both on every rank), so every
rank verifies at the same point. A mismatch raises on every rank, before the checkpoint is written: a
checkpoint holds rank 0's weights only and would hide the divergence for good.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Optional

from lightning_ddpx.engine.module.data_parallel import DistributedDataParallel

__all__ = ["ReplicaVerifier", "check_option"]


def check_option(every_n_steps: Any, local_steps_by: Optional[str]) -> None:
    """Constructor-time check that the option fits the hook (no process group; the value itself is checked
    as a count where the option is declared). ``local_steps_by``: the configured method whose replicas differ
    on purpose between synchronisations ("post-local SGD", "DiLoCo"), if any."""
    if every_n_steps is None:
        return
    if local_steps_by is not None:
        raise ValueError(
            f"DDPXStrategy: verify_replicas_every_n_steps cannot be combined with {local_steps_by}: its replicas "
            f"differ on purpose between synchronisations. Drop verify_replicas_every_n_steps (or {local_steps_by})."
        )


class ReplicaVerifier:
    """Counts optimizer steps and verifies the modules when due; the modules are held weakly, in set-up order
    (the same on every rank, so every rank verifies them in the same order)."""

    def __init__(self, every_n_steps: Optional[int]) -> None:
        self.every_n_steps = every_n_steps
        self.steps = 0  # optimizer steps seen (every optimizer counts)
        self._modules: list[weakref.ref[DistributedDataParallel]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_modules": []}  # ddpx_spawn pickles the strategy; weak references do not

    def track(self, module: DistributedDataParallel) -> None:
        self._modules.append(weakref.ref(module))

    def modules(self) -> list[DistributedDataParallel]:
        alive = [ref() for ref in self._modules]
        return [module for module in alive if module is not None]

    def after_optimizer_step(
        self,
        modules: Optional[Iterable[DistributedDataParallel]] = None,
        around: Optional[Callable[[Callable[[], None]], None]] = None,
    ) -> None:
        """One optimizer step happened; verify ``modules`` (default: the tracked ones) if it is the N-th.
        ``around(verify)`` runs the verification, the only collective here (fault tolerance: a collective
        between steps, voted on); it is not called when nothing is verified."""
        if self.every_n_steps is None:
            return
        self.steps += 1
        if self.steps % self.every_n_steps == 0:
            what = f"every {self.every_n_steps} optimizer steps"
            self._verify(modules, what, around)

    def before_save(
        self,
        modules: Optional[Iterable[DistributedDataParallel]] = None,
        around: Optional[Callable[[Callable[[], None]], None]] = None,
    ) -> None:
        """A checkpoint is about to be written: verify ``modules`` (default: the tracked ones) first."""
        if self.every_n_steps is None:
            return
        self._verify(modules, "before saving a checkpoint", around)

    def _verify(
        self,
        modules: Optional[Iterable[DistributedDataParallel]],
        what: str,
        around: Optional[Callable[[Callable[[], None]], None]],
    ) -> None:
        chosen = list(self.modules() if modules is None else modules)

        def verify() -> None:
            for module in chosen:
                module.verify_replicas(step=self.steps, what=what)

        (around or _call)(verify)


def _call(run: Callable[[], None]) -> None:
    run()
