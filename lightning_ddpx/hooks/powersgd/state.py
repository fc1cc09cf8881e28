"""PowerSGD's options and state: what is tuned, what every rank shares, what each rank keeps.

Parts by role, as in torch's ``PowerSGDState`` but as separate objects:

- :class:`PowerSGDOptions`: the hyperparameters, validated when built, before any communication;
- :class:`SharedMemory`: equal on every rank (iteration, the seed generator, warm-start Q matrices,
  compression totals), saved once in a checkpoint;
- :class:`RankMemory`: different on every rank (error feedback), saved per rank;
- per-bucket work buffers and packing plans, rebuilt on demand and never saved (kept by the hooks in
  :mod:`lightning_ddpx.hooks.powersgd`).

``state_dict()`` holds tensors and plain Python values only, so ``torch.load(weights_only=True)`` reads
it and no code is unpickled; the process group is never saved.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_ddpx.engine.option_values import check_int, is_finite_number
from lightning_ddpx.hooks.powersgd.state_check import check_state_dict

__all__ = ["CompressionStats", "PowerSGDOptions", "PowerSGDState", "RankMemory", "SharedMemory"]

_STATE_DICT_VERSION = 1


@dataclass(frozen=True)
class PowerSGDOptions:
    """PowerSGD hyperparameters, with torch's names and defaults (``PowerSGDState`` minus the group).

    Validated on construction, so a bad YAML value fails when the config is read, not at step 1000.
    """

    # Rank of the approximation P Q^T: 1-4 is typical; higher is more accurate and sends more.
    matrix_approximation_rank: int = 1
    # Plain allreduce before this step; >= 2 with error feedback or warm start (buckets are rebuilt at 1).
    start_powerSGD_iter: int = 1000
    # Compress a matrix only if (rows + cols) * rank * this < rows * cols; others are allreduced as they are.
    min_compression_rate: float = 2.0
    # Add last step's compression error to this step's gradient (PowerSGD is biased without it).
    use_error_feedback: bool = True
    # Start each step's power iteration from last step's Q instead of a fresh random draw.
    warm_start: bool = True
    # Added to column norms when orthogonalising; a tiny value like 1e-8 guards all-zero gradients.
    orthogonalization_epsilon: float = 0.0
    # Seed of the generator drawing initial Q matrices; identical on every rank.
    random_seed: int = 0
    # Iterations between compression statistics reports (0 or 1: every iteration).
    compression_stats_logging_frequency: int = 10_000
    # Draw initial Q once per shape group rather than per tensor (torch's option; affects only the draws).
    batch_tensors_with_same_shape: bool = False

    def __post_init__(self) -> None:
        for name in ("use_error_feedback", "warm_start", "batch_tensors_with_same_shape"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"PowerSGD option {name} must be True or False, got {value!r}")
        owner = "PowerSGDOptions"
        rank_hint = "Use 1 for the strongest compression and raise it (2, 4, ...) if accuracy suffers."
        check_int(owner, "matrix_approximation_rank", self.matrix_approximation_rank, 1, hint=rank_hint)
        start_hint = "It is the number of plain-allreduce steps before compression starts."
        check_int(owner, "start_powerSGD_iter", self.start_powerSGD_iter, 0, hint=start_hint)
        check_int(owner, "random_seed", self.random_seed)  # its range is checked below
        frequency = self.compression_stats_logging_frequency
        check_int(owner, "compression_stats_logging_frequency", frequency, 0, hint="0 or 1: every iteration.")
        for name in ("min_compression_rate", "orthogonalization_epsilon"):
            value = getattr(self, name)
            if not is_finite_number(value):
                raise TypeError(f"PowerSGD option {name} must be a finite number, got {value!r}")
        if (self.use_error_feedback or self.warm_start) and self.start_powerSGD_iter < 2:
            switched_on = [n for n in ("use_error_feedback", "warm_start") if getattr(self, n)]
            raise ValueError(
                f"PowerSGD option start_powerSGD_iter={self.start_powerSGD_iter} is too small with "
                f"{' and '.join(n + '=True' for n in switched_on)}: buckets are rebuilt after iteration 1 "
                "(the first backward records the order gradients become ready), which would invalidate the "
                "error and warm-start memory kept per bucket. Set start_powerSGD_iter >= 2 (10% of training "
                "is a good start), or set use_error_feedback=False and warm_start=False."
            )
        if self.min_compression_rate <= 0:
            raise ValueError(
                f"PowerSGD option min_compression_rate must be > 0, got {self.min_compression_rate}. A matrix "
                "is compressed when (rows + cols) * rank * min_compression_rate < rows * cols: use 1 to "
                "compress whenever P and Q are smaller than the matrix, 2 (the default) to require a 2x saving."
            )
        if self.orthogonalization_epsilon < 0:
            raise ValueError(
                f"PowerSGD option orthogonalization_epsilon must be >= 0, got {self.orthogonalization_epsilon}; "
                "use 0 (exact) or a tiny positive value such as 1e-8."
            )
        if not 0 <= self.random_seed < 2**32:
            raise ValueError(
                f"PowerSGD option random_seed must be in [0, 2**32), got {self.random_seed}; it seeds numpy's "
                "MT19937 generator, as torch's PowerSGD does."
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PowerSGDOptions:
        """Build from a plain mapping (a YAML section), naming unknown keys and the valid ones."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if "process_group" in unknown:
            raise ValueError(
                "PowerSGD options do not include process_group: pass it separately "
                "(build_comm_hook(..., process_group=group) or PowerSGDState.from_options(options, group))."
            )
        if unknown:
            raise ValueError(f"unknown PowerSGD option(s) {unknown}; valid options are {valid}")
        return cls(**values)


@dataclass(frozen=True)
class CompressionStats:
    """Element counts through PowerSGD, cumulative since compression started, and per bucket per step."""

    iteration: int
    numel_before: int  # elements that entered compressed steps, all buckets, cumulative
    numel_after: int  # elements actually sent for them (P, Q, uncompressed gradients), cumulative
    per_bucket: dict[int, tuple[int, int]]  # bucket index -> (before, after) of one step

    @property
    def compression_rate(self) -> float:
        """``numel_before / numel_after`` (0.0 before compression starts)."""
        return self.numel_before / self.numel_after if self.numel_after else 0.0


@dataclass
class SharedMemory:
    """State equal on every rank: saved once per checkpoint."""

    iteration: int = 0  # steps completed (moves once per step, at the last bucket)
    rng: np.random.RandomState = field(default_factory=np.random.RandomState)  # draws the Q seeds
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # warm-start Q per bucket, after averaging
    layout: dict[int, tuple[int, ...]] = field(default_factory=dict)  # which bucket layout the memory is for
    names: dict[int, tuple[str, ...]] = field(default_factory=dict)  # the parameters of that layout, by name
    q_pool: dict[str, torch.Tensor] = field(default_factory=dict)  # Q by parameter, between two layouts
    numel_before: int = 0
    numel_after: int = 0
    per_bucket: dict[int, tuple[int, int]] = field(default_factory=dict)
    next_stats_report: int = 0


@dataclass
class RankMemory:
    """State that differs per rank: each rank's checkpoint entry."""

    error: dict[int, torch.Tensor] = field(default_factory=dict)  # error feedback per bucket (packed)
    error_pool: dict[str, torch.Tensor] = field(default_factory=dict)  # by parameter, between two layouts


class PowerSGDState:
    """Options and memory of :func:`~lightning_ddpx.hooks.powersgd_hook` (and the batched variant).

    The constructor takes torch's ``PowerSGDState`` arguments, names and defaults; see
    :class:`PowerSGDOptions` for what each does. One state serves one module: its memory is keyed by
    bucket index.

    ``state_dict()`` layout (tensors and plain values only)::

        {"shared":   {"version", "options", "iteration", "rng_state", "rng_gauss", "q", "layout", "names",
                      "q_pool", "stats"},
         "per_rank": {"error", "error_pool"}}

    ``shared`` is equal on every rank (iteration, seed generator state as an int64 tensor, warm-start Q
    per bucket, the bucket layouts that memory belongs to with their parameters' names, statistics);
    ``per_rank`` is this rank's error feedback per bucket. The ``*_pool`` entries hold memory by parameter
    name while it moves between two bucket layouts (usually empty). A strategy saves ``shared`` once and
    every rank's ``per_rank``; restoring both continues training bit for bit, also into a module whose
    buckets differ (:mod:`lightning_ddpx.hooks.powersgd.remap`).

    Example::

        >>> import torch
        >>> from lightning_ddpx.hooks import PowerSGDState, powersgd_hook
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=100)
        >>> state.iter, state.compressing()
        (0, False)
        >>> model.register_comm_hook(state, powersgd_hook)  # doctest: +SKIP
        >>> torch.save(state.state_dict(), f"powersgd_rank{rank}.pt")  # doctest: +SKIP
        >>> # resume: a new state, loaded before the first step, then registered
        >>> state.load_state_dict(torch.load(f"powersgd_rank{rank}.pt", weights_only=True))  # doctest: +SKIP
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        options = PowerSGDOptions(
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            orthogonalization_epsilon=orthogonalization_epsilon,
            random_seed=random_seed,
            compression_stats_logging_frequency=compression_stats_logging_frequency,
            batch_tensors_with_same_shape=batch_tensors_with_same_shape,
        )
        self.process_group = process_group
        self.options = options
        self.shared = SharedMemory(rng=np.random.RandomState(options.random_seed))
        self.per_rank = RankMemory()
        self.runtime: dict[int, Any] = {}  # per-bucket plans and work buffers, owned by the hooks

    @classmethod
    def from_options(
        cls,
        options: PowerSGDOptions | dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> PowerSGDState:
        """A state from a :class:`PowerSGDOptions` (or a mapping of its fields, or defaults)."""
        if options is None:
            options = PowerSGDOptions()
        elif isinstance(options, dict):
            options = PowerSGDOptions.from_dict(options)
        elif not isinstance(options, PowerSGDOptions):
            raise TypeError(
                f"expected PowerSGDOptions, a dict of its fields or None, got {type(options).__name__}"
            )
        return cls(process_group, **asdict(options))

    # -------------------------------------------------------------------------------- iteration
    @property
    def iter(self) -> int:
        """Steps completed so far (torch's name)."""
        return self.shared.iteration

    @iter.setter
    def iter(self, value: int) -> None:
        self.shared.iteration = int(value)

    def compressing(self) -> bool:
        """Whether the current step is compressed (``iter >= start_powerSGD_iter``)."""
        return self.shared.iteration >= self.options.start_powerSGD_iter

    def end_bucket(self, bucket: Any, counts: tuple[int, int] | None) -> None:
        """Record one bucket's statistics; at the last bucket of a step, advance the iteration."""
        shared = self.shared
        if counts is not None:
            shared.numel_before += counts[0]
            shared.numel_after += counts[1]
            shared.per_bucket[bucket.index()] = counts
        if bucket.is_last():
            shared.iteration += 1

    # ---------------------------------------------------------------------------- statistics
    def compression_stats(self) -> CompressionStats:
        """A snapshot of the element counts (cheap: a few integers)."""
        shared = self.shared
        return CompressionStats(
            shared.iteration, shared.numel_before, shared.numel_after, dict(shared.per_bucket)
        )

    def due_compression_stats(self) -> CompressionStats | None:
        """Statistics once every ``compression_stats_logging_frequency`` compressed steps, else None.

        For a strategy or callback to poll after each step and log; the hooks themselves never log.
        """
        shared = self.shared
        if not shared.per_bucket or shared.iteration < shared.next_stats_report:
            return None
        shared.next_stats_report = shared.iteration + max(1, self.options.compression_stats_logging_frequency)
        return self.compression_stats()

    # ----------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{"shared": ..., "per_rank": ...}`` of tensors (copies) and plain values; see the class doc."""
        return {
            "shared": self.shared_state_dict(),
            "per_rank": {
                "error": {index: e.detach().clone() for index, e in self.per_rank.error.items()},
                "error_pool": {name: e.detach().clone() for name, e in self.per_rank.error_pool.items()},
            },
        }

    def shared_state_dict(self) -> dict[str, Any]:
        """The ``shared`` part of :meth:`state_dict` alone (small: no error feedback), e.g. for a newcomer to
        a fault-tolerant run, whose own error feedback starts from zero."""
        shared = self.shared
        _, keys, position, has_gauss, gauss = shared.rng.get_state(legacy=True)
        rng_state = torch.tensor([*keys.tolist(), int(position), int(has_gauss)], dtype=torch.int64)
        return {
            "version": _STATE_DICT_VERSION,
            "options": asdict(self.options),
            "iteration": shared.iteration,
            "rng_state": rng_state,
            "rng_gauss": float(gauss),
            "q": {index: q.detach().clone() for index, q in shared.q.items()},
            "layout": {index: list(signature) for index, signature in shared.layout.items()},
            "names": {index: list(names) for index, names in shared.names.items()},
            "q_pool": {name: q.detach().clone() for name, q in shared.q_pool.items()},
            "stats": {
                "numel_before": shared.numel_before,
                "numel_after": shared.numel_after,
                "per_bucket": {index: list(c) for index, c in shared.per_bucket.items()},
                "next_report": shared.next_stats_report,
            },
        }

    def load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        """Restore what :meth:`state_dict` returned (on this rank: its own ``per_rank`` part).

        ``per_rank`` may be empty or missing (e.g. resuming on another world size): error feedback then
        starts from zero. Memory saved with another ``matrix_approximation_rank`` cannot be reused and is
        dropped with a warning (so is memory saved with another ``min_compression_rate``, which changes
        what is compressed); options themselves always come from this state, not the checkpoint. The whole
        ``state_dict`` is checked before anything is adopted: a missing entry or one of the wrong type or
        size raises ``ValueError`` naming it, and this state is left unchanged.
        """
        if not isinstance(state_dict, dict) or "shared" not in state_dict:
            raise ValueError(
                "PowerSGDState.load_state_dict expects {'shared': ..., 'per_rank': ...} as returned by "
                f"state_dict(), got {type(state_dict).__name__} with keys {list(state_dict)[:5] if isinstance(state_dict, dict) else '-'}"
            )
        shared_in, rank_in = state_dict["shared"], state_dict.get("per_rank") or {}
        version = shared_in.get("version") if isinstance(shared_in, dict) else _STATE_DICT_VERSION
        if version != _STATE_DICT_VERSION:
            raise ValueError(
                f"PowerSGD state_dict version {version!r} is not supported (this version reads "
                f"{_STATE_DICT_VERSION}); it was written by another lightning-ddpx release."
            )
        options = self.options
        changed = _memory_changing_options(shared_in, options)
        keep_memory = not changed
        check_state_dict(
            state_dict,
            options.matrix_approximation_rank,
            options.min_compression_rate,
            options.batch_tensors_with_same_shape,
            sizes=keep_memory,
        )
        if not keep_memory:
            warnings.warn(
                f"PowerSGD state was saved with {' and '.join(changed)}: warm-start and error-feedback memory "
                "are reset.",
                stacklevel=2,
            )
        self.shared = _restored_shared(shared_in, keep_memory)
        errors = rank_in.get("error", {}) if keep_memory else {}
        error_pool = rank_in.get("error_pool", {}) if keep_memory else {}
        self.per_rank = RankMemory(
            error={int(i): e.detach().clone() for i, e in errors.items()},
            error_pool={str(n): e.detach().clone() for n, e in error_pool.items()},
        )
        self.runtime.clear()

    def __repr__(self) -> str:
        return f"PowerSGDState(iter={self.iter}, {self.options})"


def _memory_changing_options(shared_in: Any, options: PowerSGDOptions) -> list[str]:
    """The saved options, of those that decide which matrices are compressed (so the memory's sizes),
    that differ from ``options``, each as ``name=saved (this state uses ...)``."""
    saved = shared_in.get("options") if isinstance(shared_in, dict) else None
    saved = saved if isinstance(saved, dict) else {}
    return [
        f"{name}={saved.get(name)} (this state uses {getattr(options, name)})"
        for name in ("matrix_approximation_rank", "min_compression_rate")
        if saved.get(name) != getattr(options, name)
    ]


def _restored_shared(shared_in: dict[str, Any], keep_memory: bool) -> SharedMemory:
    """The shared part of a checked state dict, as this state holds it (without warm-start memory unless
    ``keep_memory``); the seed generator continues exactly where the saved one stopped."""
    rng_state = shared_in["rng_state"].tolist()
    rng = np.random.RandomState()
    rng.set_state(
        (
            "MT19937",
            np.array(rng_state[:624], dtype=np.uint32),
            rng_state[624],
            rng_state[625],
            float(shared_in["rng_gauss"]),
        )
    )
    stats = shared_in["stats"]
    memory = shared_in if keep_memory else {"q": {}, "layout": {}}
    return SharedMemory(
        iteration=int(shared_in["iteration"]),
        rng=rng,
        q={int(i): q.detach().clone() for i, q in memory["q"].items()},
        layout={int(i): tuple(int(v) for v in sig) for i, sig in memory["layout"].items()},
        names={int(i): tuple(str(n) for n in names) for i, names in memory.get("names", {}).items()},
        q_pool={str(n): q.detach().clone() for n, q in memory.get("q_pool", {}).items()},
        numel_before=int(stats["numel_before"]),
        numel_after=int(stats["numel_after"]),
        per_bucket={int(i): (int(c[0]), int(c[1])) for i, c in stats["per_bucket"].items()},
        next_stats_report=int(stats["next_report"]),
    )
