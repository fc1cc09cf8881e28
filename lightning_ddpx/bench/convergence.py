"""Time to accuracy: train a real task to the end once per contender, and compare the curves.

The step-time benchmark (:mod:`lightning_ddpx.bench.cli`) says how fast a hook makes a step; only training a
real task says whether the steps of a lossy hook still get the model where allreduce gets it. Here each
contender runs ``Trainer.fit`` for the same number of steps on 2 processes (fresh processes per contender,
over loopback or an emulated link), recording per step the training wall time, the train loss and the bytes
its collectives sent, and at every validation the metric. From the curves:

* **time to target**: training wall time (validation excluded) until the validation metric first reaches
  the target (by default what torch's DDP ends at, less the tolerance);
* **accuracy at equal steps**: the mean of the last two validations, compared with our allreduce's. A lossy
  hook is "within tolerance" when it is at most ``tolerance`` worse. Only such hooks may be recommended.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CONVERGENCE_CONTENDERS",
    "ConvergenceContender",
    "ConvergenceRow",
    "START_POWERSGD_ITER",
    "accuracy_verdicts",
    "convergence_contenders_named",
    "recommend_from_convergence",
    "summarize_runs",
]

START_POWERSGD_ITER = 10  # allreduce for the first steps, as torch advises, then compress
TOLERANCE = 0.01  # default: a lossy hook may end at most this much worse than allreduce (absolute)


@dataclass(frozen=True)
class ConvergenceContender:
    """One way to train: torch's DDP (``strategy=None``) or ``DDPXStrategy(**strategy)``."""

    name: str
    strategy: dict[str, Any] | None  # DDPXStrategy keyword arguments; None: torch's strategy="ddp"
    lossy: bool = False  # changes the gradient: needs a convergence check before it is recommended
    note: str = ""
    # Runs this many times the link's steps (its steps are that much cheaper): time to target is then
    # measurable; accuracy and loss are still compared at the reference's number of steps.
    steps_factor: int = 1

    @property
    def torch_ddp(self) -> bool:
        return self.strategy is None

    def strategy_arguments(self) -> str:
        """How to get this contender in a Trainer (what the recommendation prints)."""
        if self.strategy is None:
            return 'strategy="ddp"'
        return "DDPXStrategy(" + ", ".join(f"{k}={v!r}" for k, v in self.strategy.items()) + ")"


def _powersgd(rank: int, error_feedback: bool = True, hook: str = "powersgd") -> dict[str, Any]:
    options: dict[str, Any] = {"matrix_approximation_rank": rank, "start_powerSGD_iter": START_POWERSGD_ITER}
    if not error_feedback:
        options["use_error_feedback"] = False
    return {"comm_hook": hook, "powersgd": options}


def _post_local_sgd() -> ConvergenceContender | None:
    """Post-local SGD: each rank steps alone (``subgroup=1``) after the warm-up, parameters averaged every
    4 steps. ``subgroup=None`` would mean "the ranks on one machine", which on an emulated two-node link
    (one host name) is every rank: plain DDP plus redundant averaging."""
    from lightning_ddpx.hooks import available_hooks

    if "post_local_sgd" not in available_hooks():
        return None
    return ConvergenceContender(
        "post-local-sgd",
        {
            "comm_hook": "post_local_sgd",
            "post_local_sgd": {"start_localSGD_iter": START_POWERSGD_ITER, "period": 4, "subgroup": 1},
        },
        lossy=True,
        note="local steps, parameters averaged every 4 steps",
    )


# DiLoCo for slow links: an outer step every H = 20 inner steps, the delta sent in 4 bits (int4: blocks of 128
# elements with a scale each, 7.5x fewer bytes than fp32), so these send about 150x fewer bytes than DDP, which
# sends every gradient every step (streaming: the same total, in F pieces). At equal bytes a short period in
# 4 bits beat a long one in bf16 (H = 70): the period, not the precision, decided the loss on digits
# (docs/convergence.md, "DiLoCo and streaming DiLoCo", has the sweep). The outer optimizer: the papers'
# SGD with Nesterov momentum (lr 0.7), with momentum 0.3 instead of their 0.9: these runs have 8-24 outer
# steps from a random start, where 0.9 over-extrapolates the stale first deltas.
DILOCO = {"period": 20, "outer_lr": 0.7, "outer_momentum": 0.3, "precision": "int4"}
# Streaming: 2 fragments, one exchange every 10 steps, each overlapped with the next inner step (tau = 1, the
# local step of that fragment discarded when the mean arrives: mixing 0).
STREAMING_DILOCO = {
    "period": 20,
    "fragments": 2,
    "overlap_steps": 1,
    "mixing": 0.0,
    "outer_lr": 0.7,
    "outer_momentum": 0.3,
    "precision": "int4",
}
# Sparse (SparseLoCo): each exchange sends the top 4 % of every 4096-element chunk of each tensor (its change
# plus the error buffer of what was not sent before), 2 bits a value and 12 a position, about 1100x fewer
# bytes per step than DDP; the rest stays in the error buffer. The outer step is plain SGD at lr 1 (the error
# buffer carries what momentum would): on pydoc-lm it beat Nesterov momentum 0.3 at lr 0.7, and 4 % every 20
# steps beat 2 % every 10 and 1 % every 5 at about the same bytes (docs/convergence.md, "The sparse exchange").
# Every rank receives the other ranks' payloads (an all-gather).
SPARSE_DILOCO = {
    "period": 20,
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "nesterov": False,
    "sparse": {"density": 0.04, "bits": 2, "chunk": 4096, "error_decay": 0.999},
}
# Its steps send (almost) nothing, so they are several times cheaper on a slow link: it runs 3x the steps,
# so that time to target is measured, and is judged for accuracy and loss at the reference's step count.
DILOCO_STEPS_FACTOR = 3


def _diloco() -> tuple[ConvergenceContender, ...]:
    """DiLoCo and streaming DiLoCo, validated on the global (outer) model (the convergence worker does)."""
    from lightning_ddpx.hooks import available_hooks

    if "diloco" not in available_hooks():
        return ()
    return (
        ConvergenceContender(
            "diloco",
            {"comm_hook": "diloco", "diloco": dict(DILOCO)},
            lossy=True,
            note=f"local steps, outer Nesterov step (momentum 0.3) every {DILOCO['period']}, int4 delta; "
            "3x the steps",
            steps_factor=DILOCO_STEPS_FACTOR,
        ),
        ConvergenceContender(
            "streaming-diloco",
            {"comm_hook": "diloco", "diloco": dict(STREAMING_DILOCO)},
            lossy=True,
            note="2 fragments staggered over 20 steps, each overlapped with one step, outer momentum 0.3, int4; "
            "3x the steps",
            steps_factor=DILOCO_STEPS_FACTOR,
        ),
        ConvergenceContender(
            "sparse-diloco",
            {"comm_hook": "diloco", "diloco": dict(SPARSE_DILOCO)},
            lossy=True,
            note=f"DiLoCo every {SPARSE_DILOCO['period']}, each chunk's top 4 % in 2 bits, error feedback, "
            "outer SGD lr 1; "
            "3x the steps",
            steps_factor=DILOCO_STEPS_FACTOR,
        ),
    )


CONVERGENCE_CONTENDERS: tuple[ConvergenceContender, ...] = (
    ConvergenceContender("torch-ddp", None, note="torch's DistributedDataParallel: the reference"),
    ConvergenceContender("allreduce", {}, note="our exact average"),
    ConvergenceContender("fp16", {"comm_hook": "fp16"}, lossy=True, note="gradients sent as fp16"),
    *(
        ConvergenceContender(f"powersgd-r{r}", _powersgd(r), lossy=True, note=f"rank {r}, error feedback")
        for r in (1, 2, 4)
    ),
    *(
        ConvergenceContender(
            f"powersgd-r{r}-noef", _powersgd(r, False), lossy=True, note=f"rank {r}, no error feedback"
        )
        for r in (1, 2, 4)
    ),
    ConvergenceContender(
        "batched-r2",
        _powersgd(2, hook="batched_powersgd"),
        lossy=True,
        note="each bucket as one square matrix",
    ),
)


def all_contenders() -> tuple[ConvergenceContender, ...]:
    """The table above plus the contenders whose hooks exist only in some versions (post-local SGD, DiLoCo)."""
    extra = _post_local_sgd()
    return CONVERGENCE_CONTENDERS + ((extra,) if extra is not None else ()) + _diloco()


def convergence_contenders_named(names: list[str] | None) -> tuple[ConvergenceContender, ...]:
    """The contenders to run, in canonical order; ``None``: all. Unknown names are an error naming the known."""
    known = {c.name: c for c in all_contenders()}
    if names is None:
        return tuple(known.values())
    unknown = [n for n in names if n not in known]
    if unknown:
        hint = (
            " (post-local-sgd needs the post_local_sgd hook, not in this version)"
            if "post-local-sgd" in unknown
            else ""
        )
        raise ValueError(f"unknown contender(s) {unknown}{hint}; choose from {', '.join(known)}")
    return tuple(c for c in known.values() if c.name in names)


# -------------------------------------------------------------------------------------------- summary
@dataclass
class ConvergenceRow:
    """One contender's figures from one run (rank 0's clock and counters)."""

    name: str
    steps: int
    step_ms: float  # median training step (validation excluded)
    bytes_per_step: float | None  # mean payload bytes its collectives sent per step (warm-up included)
    bytes_per_step_median: float | None  # median: what a step sends once PowerSGD compresses
    final_metric: float | None  # mean of the last two validations (equal steps for every contender)
    time_to_target_s: float | None  # None: never reached the target
    vs_torch: float | None  # time_to_target / torch-ddp's time_to_target
    within_tolerance: bool | None  # vs allreduce (else torch-ddp) at equal steps; None: not checked
    lossy: bool
    strategy: str
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    final_val_loss: float | None = None  # mean of the last two validations' val_loss, where logged
    bytes_vs_torch: float | None = None  # torch-ddp's mean bytes per step / this contender's (x fewer)
    bytes_to_target: float | None = None  # bytes sent until the validation that first reached the target
    # mean bytes per step that reached this rank: an all-reduce's result (what it sends); the sparse
    # exchange's all-gather, every other rank's payload
    bytes_received_per_step: float | None = None
    received_vs_torch: float | None = None  # torch-ddp's mean bytes per step / this contender's received


def _final(curve: list[dict[str, Any]]) -> float | None:
    values = [v["metric"] for v in curve[-2:] if v["metric"] is not None and math.isfinite(v["metric"])]
    return sum(values) / len(values) if values else None


def _final_loss(curve: list[dict[str, Any]]) -> float | None:
    values = [
        v["val_loss"] for v in curve[-2:] if v.get("val_loss") is not None and math.isfinite(v["val_loss"])
    ]
    return sum(values) / len(values) if values else None


def _bytes_until(run: dict[str, Any], steps: int) -> float | None:
    sent = run["bytes_sent"][:steps]
    if not sent or any(b is None or not math.isfinite(b) for b in sent):
        return None
    return float(sum(sent))


def _reached_point(curve: list[dict[str, Any]], target: float, mode: str) -> dict[str, Any] | None:
    for point in curve:
        value = point["metric"]
        if value is not None and (value >= target if mode == "max" else value <= target):
            return point
    return None


def _reached(curve: list[dict[str, Any]], target: float, mode: str) -> float | None:
    point = _reached_point(curve, target, mode)
    return None if point is None else point["time_s"]


def default_target(runs: dict[str, dict[str, Any]], mode: str, tolerance: float) -> float | None:
    """torch's DDP's final metric, less the tolerance (plus, for ``mode="min"``); else allreduce's."""
    for reference in ("torch-ddp", "allreduce"):
        if reference in runs and (final := _final(runs[reference]["val"])) is not None:
            return final - tolerance if mode == "max" else final + tolerance
    return None


def summarize_runs(
    contenders: tuple[ConvergenceContender, ...],
    runs: dict[str, dict[str, Any]],
    target: float | None,
    mode: str = "max",
    tolerance: float = TOLERANCE,
) -> list[ConvergenceRow]:
    """Rows in contender order for the contenders that ran; ``runs[name]`` is rank 0's worker record."""
    # Accuracy at equal steps is checked against our allreduce, else torch's DDP (the same average, which
    # tests/engine/test_engine_oracle.py shows step by step): lossless and lossy runs on the same seeds and data.
    source = next((name for name in ("allreduce", "torch-ddp") if name in runs), None)
    reference = _final(runs[source]["val"]) if source is not None else None
    equal_steps = len(runs[source]["time_s"]) if source is not None else None
    rows = []
    for c in contenders:
        if c.name not in runs:
            continue
        run = runs[c.name]
        times = run["time_s"]
        steps_ms = sorted(1e3 * (b - a) for a, b in zip(times, times[1:])) or [1e3 * times[0]]
        sent = [b for b in run["bytes_sent"] if b is not None and math.isfinite(b)]
        received = [b for b in run.get("bytes_received", []) if b is not None and math.isfinite(b)]
        # a contender given more steps (steps_factor) is judged at the reference's number of steps
        equal = [v for v in run["val"] if equal_steps is None or v["step"] <= equal_steps]
        final = _final(equal)
        reached = None if target is None else _reached_point(run["val"], target, mode)
        within = None
        if reference is not None and final is not None:
            within = final >= reference - tolerance if mode == "max" else final <= reference + tolerance
        rows.append(
            ConvergenceRow(
                name=c.name,
                steps=len(times),
                step_ms=steps_ms[len(steps_ms) // 2],
                bytes_per_step=sum(sent) / len(sent) if sent else None,
                bytes_per_step_median=sorted(sent)[len(sent) // 2] if sent else None,
                final_metric=final,
                time_to_target_s=None if reached is None else reached["time_s"],
                vs_torch=None,
                within_tolerance=within,
                lossy=c.lossy,
                strategy=c.strategy_arguments(),
                note=c.note,
                final_val_loss=_final_loss(equal),
                bytes_to_target=None if reached is None else _bytes_until(run, reached["step"]),
                bytes_received_per_step=sum(received) / len(received) if received else None,
                extra={"final_at_end": _final(run["val"]), "val_loss_at_end": _final_loss(run["val"])},
            )
        )
    torch_time = next((r.time_to_target_s for r in rows if r.name == "torch-ddp"), None)
    torch_bytes = next((r.bytes_per_step for r in rows if r.name == "torch-ddp"), None)
    for row in rows:
        if torch_time and row.time_to_target_s is not None:
            row.vs_torch = row.time_to_target_s / torch_time
        if torch_bytes and row.bytes_per_step:
            row.bytes_vs_torch = torch_bytes / row.bytes_per_step
        if torch_bytes and row.bytes_received_per_step:
            row.received_vs_torch = torch_bytes / row.bytes_received_per_step
    return rows


def accuracy_verdicts(rows: list[ConvergenceRow]) -> dict[str, bool]:
    """``{contender: within tolerance of allreduce}`` for the rows that could be checked."""
    return {r.name: r.within_tolerance for r in rows if r.within_tolerance is not None}


def recommend_from_convergence(rows: list[ConvergenceRow], metric: str, tolerance: float) -> str:
    """The contender of ours reaching the target soonest among those exact or within tolerance.

    The lossless reference is our allreduce, else torch's DDP (the same average; on the slow link only
    torch's DDP may have been run): a lossy contender must beat it by more than 5 % to be recommended.
    """
    ours = [r for r in rows if r.name != "torch-ddp"]
    plain = next((r for r in rows if r.name == "allreduce"), None)
    plain = plain or next((r for r in rows if r.name == "torch-ddp"), None)
    if plain is None or not any(r.within_tolerance is not None for r in rows):
        return (
            "No recommendation: accuracy could not be checked because allreduce was not run "
            "(add allreduce to --hooks)."
        )
    candidates = [r for r in ours if r.time_to_target_s is not None and (not r.lossy or r.within_tolerance)]
    if plain.time_to_target_s is not None and plain not in candidates:
        candidates.append(plain)
    if not candidates:
        return "No recommendation: no contender of ours reached the target; train longer (--max-steps)."
    best = min(candidates, key=lambda r: r.time_to_target_s)
    if (
        best is not plain
        and plain.time_to_target_s is not None
        and best.time_to_target_s > 0.95 * plain.time_to_target_s
    ):
        best = plain  # saving under 5 % is not worth a lossy hook
    strategy = "DDPXStrategy()" if best.name == "torch-ddp" else best.strategy
    text = f"Recommended: {'allreduce' if best.name == 'torch-ddp' else best.name} -> {strategy}"
    if best is not plain and plain.time_to_target_s is not None:
        text += (
            f" (reaches the target in {best.time_to_target_s / plain.time_to_target_s:.2f}x {plain.name}'s time; "
            f"{metric} at equal steps within {tolerance:g} of {plain.name})"
        )
    elif best is plain:
        text += ": no lossy hook both reached the target sooner and kept accuracy within tolerance"
    rejected = [r for r in ours if r.lossy and r.within_tolerance is False]
    if rejected:
        text += ". Outside tolerance, not recommended: " + ", ".join(
            f"{r.name} ({metric} {r.final_metric:.4f} vs {plain.final_metric:.4f})" for r in rejected
        )
    return text + "."


def rows_as_json(rows: list[ConvergenceRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


# ---------------------------------------------------------------------------------------------- running
def run_convergence(
    contenders: tuple[ConvergenceContender, ...],
    *,
    model: str,
    datamodule: str | None,
    link: str | None,
    max_steps: int,
    val_every: int,
    metric: str = "val_acc",
    seed: int = 0,
    world_size: int = 2,
    timeout_s: float = 1800.0,
    done: Any = None,
) -> dict[str, dict[str, Any]]:
    """Train once per contender (fresh processes each, one after another); rank 0's record by name.

    ``done(name, record)`` is called after each contender, e.g. to save partial results.
    """
    from lightning_ddpx.bench.launch import run_ranks

    runs: dict[str, dict[str, Any]] = {}
    for contender in contenders:
        print(f"  {contender.name}: {contender.strategy_arguments()}", flush=True)
        config = {
            "model": model,
            "datamodule": datamodule,
            "contender": contender.name,
            "strategy": contender.strategy,  # so contenders built in Python (not in the table) run too
            "world_size": world_size,
            "max_steps": max_steps * contender.steps_factor,
            "val_every": val_every,
            "metric": metric,
            "seed": seed,
        }
        record = run_ranks(config, link, timeout_s, worker="lightning_ddpx.bench.convergence_worker")[0]
        runs[contender.name] = record
        if done is not None:
            done(contender.name, record)
    return runs
