"""The convergence benchmark's table and its picture: validation metric against training wall time."""

from __future__ import annotations

from typing import Any

from lightning_ddpx.bench.convergence import ConvergenceRow
from lightning_ddpx.bench.timing import format_table

__all__ = ["render_convergence_table", "write_curves"]

_COLOURS = {  # fixed per contender, so the panels and the figures of both tasks read alike
    "torch-ddp": "#000000",
    "allreduce": "#7f7f7f",
    "fp16": "#1f77b4",
    "powersgd-r1": "#ff9896",
    "powersgd-r2": "#d62728",
    "powersgd-r4": "#8c1a1a",
    "powersgd-r1-noef": "#c5b0d5",
    "powersgd-r2-noef": "#9467bd",
    "powersgd-r4-noef": "#543b7a",
    "batched-r2": "#2ca02c",
    "post-local-sgd": "#ff7f0e",
}


def render_convergence_table(rows: list[ConvergenceRow], metric: str, target: float | None) -> str:
    def opt(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    body = [
        [
            r.name,
            opt(r.time_to_target_s, ".1f") if target is not None else "-",
            opt(r.vs_torch, ".2f"),
            opt(r.final_metric, ".4f"),
            {True: "yes", False: "NO", None: "-"}[r.within_tolerance] if r.lossy else "exact",
            f"{r.step_ms:.0f}",
            opt(None if r.bytes_per_step is None else r.bytes_per_step / 1e6, ".3f"),
            opt(None if r.bytes_per_step_median is None else r.bytes_per_step_median / 1e6, ".3f"),
        ]
        for r in rows
    ]
    reach = f"s to {metric} {target:.4f}" if target is not None else "s to target"
    header = [
        "contender",
        reach,
        "/ torch-ddp",
        f"final {metric}",
        "within tol.",
        "step ms",
        "MB/step mean",
        "median",
    ]
    return format_table(header, body)


def write_curves(
    panels: dict[str, dict[str, dict[str, Any]]],
    metric: str,
    targets: dict[str, float | None],
    title: str,
    path: str,
) -> str | None:
    """One panel per link (``panels[link][contender] = rank 0's record``), metric against wall time.

    Returns ``None`` when written, else why not (matplotlib is the optional ``bench`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning-ddpx[bench]'); no plot written"
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for axis, (link, runs) in zip(axes[0], panels.items()):
        for name, run in runs.items():
            points = [(p["time_s"], p["metric"]) for p in run["val"] if p["metric"] is not None]
            if not points:
                continue
            xs, ys = zip(*points)
            style = "--" if name.endswith("-noef") else "-"
            width = 2.2 if name in ("torch-ddp", "powersgd-r2", "powersgd-r4") else 1.2
            axis.plot(xs, ys, style, color=_COLOURS.get(name), lw=width, label=name, marker=".", ms=3)
        if targets.get(link) is not None:
            axis.axhline(targets[link], color="#bbbbbb", lw=0.8, ls=":")
        axis.set_title(link, fontsize=10)
        axis.set_xlabel("training wall time (s)")
        axis.set_xscale("log")
        axis.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(metric)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for axis in axes[0][1:]:
        more_h, more_l = axis.get_legend_handles_labels()
        for h, label in zip(more_h, more_l):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    figure.legend(handles, labels, loc="center right", fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0, 0.85, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None
