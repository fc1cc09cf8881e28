"""Turn the ranks' raw timings into the table, the recommendation, the JSON and the chart."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from lightning_ddpx.bench.contenders import Contender
from lightning_ddpx.bench.timing import format_table, percentile, summarize_pair

__all__ = ["Row", "recommend", "render_table", "summarize", "write_chart"]

BASELINE = "allreduce"  # ratios are against our allreduce: the hook-free choice


@dataclass(frozen=True)
class Row:
    """One contender's figures (rank 0's clock; every rank does the same work)."""

    name: str
    median_ms: float
    p25_ms: float
    p75_ms: float
    vs_allreduce: float | None  # median of same-round step-time ratios
    bytes_sent: float | None  # per step; for torch's DDP the gradient bytes (it allreduces them all)
    exposed_comm_ms: float | None  # ours only: communication not hidden behind backward
    accuracy_cost: str
    accuracy_note: str
    strategy: str


def summarize(contenders: tuple[Contender, ...], rank0: dict[str, Any]) -> list[Row]:
    times = rank0["times_s"]
    rows = []
    for c in contenders:
        ms = [1e3 * t for t in times[c.name]]
        ratio = summarize_pair(times[BASELINE], times[c.name]).ratio if BASELINE in times else None
        sent = [s for s in rank0["bytes_sent"].get(c.name, []) if not math.isnan(s)]
        exposed = rank0["exposed_comm_s"].get(c.name, [])
        rows.append(
            Row(
                name=c.name,
                median_ms=percentile(ms, 50),
                p25_ms=percentile(ms, 25),
                p75_ms=percentile(ms, 75),
                vs_allreduce=ratio,
                bytes_sent=percentile(sent, 50)
                if sent
                else (rank0["gradient_bytes"] if c.torch_ddp else None),
                exposed_comm_ms=1e3 * percentile(exposed, 50) if exposed else None,
                accuracy_cost=c.accuracy_cost,
                accuracy_note=c.accuracy_note,
                strategy=c.strategy_arguments(),
            )
        )
    return rows


def recommend(
    contenders: tuple[Contender, ...], rows: list[Row], accuracy: dict[str, bool] | None = None
) -> str:
    """One line: the fastest contender whose accuracy is known to hold, and what else to know.

    Exact hooks (allreduce) always qualify. A lossy hook (fp16, bf16, PowerSGD) qualifies only if
    ``accuracy`` -- the verdicts of a convergence run (``--convergence``; ``--accuracy-from``) -- says it
    stayed within tolerance of allreduce at equal steps; a faster lossy hook that could not be checked, or
    failed the check, is named with the reason instead.
    """
    checked = accuracy or {}
    exact = {c.name for c in contenders if c.ours and c.accuracy_cost == "none"}
    passed = {c.name for c in contenders if c.ours and c.accuracy_cost != "none" and checked.get(c.name)}
    candidates = [r for r in rows if r.name in exact | passed]
    if not candidates:
        return "No recommendation: run allreduce too (--hooks ...,allreduce), the exact reference."
    best = min(candidates, key=lambda r: r.median_ms)
    plain = next((r for r in rows if r.name == BASELINE), None)
    if plain is not None and best.name != BASELINE and best.median_ms > 0.95 * plain.median_ms:
        best = plain  # compression that saves under 5 % is not worth its accuracy cost
    text = f"Recommended: {best.name} -> {best.strategy}"
    if plain is not None and best is not plain:
        text += (
            f" ({plain.median_ms / best.median_ms:.2f}x faster than allreduce; its accuracy was within "
            "tolerance of allreduce in the convergence run)"
        )
    elif plain is not None:
        noop = next((r for r in rows if r.name == "noop"), None)
        why = "no checked hook saves time here"
        if not any(
            r.name not in exact and r.median_ms < 0.95 * plain.median_ms for r in rows if r.name != "noop"
        ):
            why = "compression does not pay here: what it saves in communication it spends in computation"
        if noop is not None:
            why += (
                f" (steps without any communication would be {plain.median_ms / noop.median_ms:.2f}x faster)"
            )
        text += f": {why}"
    lossy = {c.name: c for c in contenders if c.ours and c.accuracy_cost not in ("none", "not for training")}
    faster = [
        r for r in rows if r.name in lossy and r.name not in passed and r.median_ms < 0.9 * best.median_ms
    ]
    if faster:
        quickest = min(faster, key=lambda r: r.median_ms)
        speed = f"{quickest.name} is faster ({best.median_ms / quickest.median_ms:.2f}x)"
        if quickest.name in checked:
            text += f". {speed} but lost accuracy beyond the tolerance in the convergence run"
        else:
            text += (
                f". {speed} but its accuracy on this model could not be checked ({quickest.accuracy_note}): "
                "run python -m lightning_ddpx.bench --convergence on your task and pass its --json as "
                "--accuracy-from"
            )
    return text + "."


def render_table(rows: list[Row]) -> str:
    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value / 1e6:.2f}"

    body = [
        [
            r.name,
            f"{r.median_ms:.1f}",
            f"{r.p25_ms:.1f}-{r.p75_ms:.1f}",
            "-" if r.vs_allreduce is None else f"{r.vs_allreduce:.2f}",
            mb(r.bytes_sent),
            "-" if r.exposed_comm_ms is None else f"{r.exposed_comm_ms:.1f}",
            r.accuracy_cost,
        ]
        for r in rows
    ]
    header = ["hook", "step ms", "p25-p75", "/ allreduce", "MB sent/step", "exposed ms", "accuracy cost"]
    return format_table(header, body)


def rows_as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def write_chart(rows: list[Row], title: str, path: str) -> str | None:
    """A bar chart of step time (p25-p75 whiskers) with the exposed part marked; ``None`` if written, else
    why not (matplotlib is an optional extra: ``pip install lightning-ddpx[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning-ddpx[bench]'); no chart written"
    names = [r.name for r in rows]
    medians = [r.median_ms for r in rows]
    errors = [[r.median_ms - r.p25_ms for r in rows], [r.p75_ms - r.median_ms for r in rows]]
    exposed = [r.exposed_comm_ms or 0.0 for r in rows]
    figure, axis = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.0))
    axis.bar(names, medians, yerr=errors, color="#8fb3d9", capsize=3, label="step time (median, p25-p75)")
    axis.bar(names, exposed, color="#d9534f", width=0.4, label="exposed communication (median)")
    axis.set_ylabel("ms per step")
    axis.set_title(title, fontsize=10)
    axis.tick_params(axis="x", rotation=30)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None
