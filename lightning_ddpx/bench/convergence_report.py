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
    "diloco": "#17becf",
    "streaming-diloco": "#e377c2",
    "sparse-diloco": "#bcbd22",
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
            opt(r.bytes_vs_torch, ".1f"),
            opt(r.received_vs_torch, ".1f"),
            opt(None if r.bytes_to_target is None else r.bytes_to_target / 1e6, ".0f"),
            opt(r.final_val_loss, ".4f"),
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
        "x fewer B/step",
        "x fewer recv.",
        "MB to target",
        "final val_loss",
    ]
    if all(r.received_vs_torch is None for r in rows):  # only an all-gather receives more than it sends
        header.pop(9)
        body = [cells[:9] + cells[10:] for cells in body]
    return format_table(header, body)


def write_curves(
    panels: dict[str, dict[str, dict[str, Any]]],
    metric: str,
    targets: dict[str, float | None],
    title: str,
    path: str,
    x: str = "time_s",
) -> str | None:
    """One panel per link (``panels[link][contender] = rank 0's record``), metric against wall time
    (``x="time_s"``) or against steps (``x="step"``: accuracy at equal steps, where the link plays no part).

    Returns ``None`` when written, else why not (matplotlib is the optional ``bench`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning-ddpx[bench]'); no plot written"
    width = 4.4 * len(panels) + 1.8  # the legend gets its own 1.8 inches on the right
    figure, axes = plt.subplots(1, len(panels), figsize=(width, 3.8), squeeze=False, sharey=True)
    low, high = _y_range(panels)
    for axis, (link, runs) in zip(axes[0], panels.items()):
        for name, run in runs.items():
            points = [(p[x], p["metric"]) for p in run["val"] if p["metric"] is not None]
            if not points:
                continue
            xs, ys = zip(*points)
            style = "--" if name.endswith("-noef") else "-"
            line = 2.2 if name in ("torch-ddp", "powersgd-r2", "powersgd-r4") else 1.2
            axis.plot(xs, ys, style, color=_COLOURS.get(name), lw=line, label=name, marker=".", ms=3)
        if targets.get(link) is not None:
            axis.axhline(targets[link], color="#bbbbbb", lw=0.8, ls=":")
        axis.set_title(link, fontsize=10)
        axis.set_xlabel("training wall time (s)" if x == "time_s" else "step")
        if x == "time_s":
            axis.set_xscale("log")
        axis.set_ylim(low, high)
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
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
    figure.subplots_adjust(left=0.8 / width, right=1 - 1.9 / width, bottom=0.14, top=0.84, wspace=0.06)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None


def _y_range(panels: dict[str, dict[str, dict[str, Any]]]) -> tuple[float, float]:
    """From the reference's first validation to the best value: the region where contenders differ.

    Curves far below (a contender that never learns) leave the panel at the bottom; the table has them.
    """
    values = [p["metric"] for runs in panels.values() for run in runs.values() for p in run["val"]]
    values = [v for v in values if v is not None]
    if not values:
        return 0.0, 1.0
    firsts = [
        runs[name]["val"][0]["metric"]
        for runs in panels.values()
        for name in ("torch-ddp", "allreduce")
        if name in runs and runs[name]["val"] and runs[name]["val"][0]["metric"] is not None
    ]
    low, high = (min(firsts) if firsts else min(values)), max(values)
    margin = 0.05 * (high - low or 1.0)
    return low - margin, high + margin
