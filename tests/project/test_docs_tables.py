"""The results tables on the docs pages are the ones their benchmarks' own renderers give from the committed
results: regenerated here from ``benchmarks/results/convergence/`` and compared, so that a table cannot drift
from its measurement (re-running a renderer rewrites the files; this catches a page or a file left behind)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "convergence"
TASKS = ("digits", "pydoc-lm")
LINKS = ("loopback", "1gbit", "100mbit")


def _link_report(task: str, link: str) -> str:
    from benchmarks.bench_convergence import link_report
    from lightning_ddpx.bench.convergence import TOLERANCE

    saved = json.loads((RESULTS / f"{task}_{link}.json").read_text())
    return link_report(saved, None, TOLERANCE)[3]


@pytest.mark.parametrize("task", TASKS)
def test_the_convergence_tables_are_the_ones_bench_convergence_renders(task: str) -> None:
    """``<task>.md`` and each link's table and recommendation on docs/convergence.md are what
    ``bench_convergence.py --plot-only`` writes from ``<task>_<link>.json``."""
    expected = [_link_report(task, link) for link in LINKS]
    written = (RESULTS / f"{task}.md").read_text()
    assert written == "\n".join([f"### {task}\n", *expected]), (
        f"benchmarks/results/convergence/{task}.md is not what its JSON renders: run "
        "python benchmarks/bench_convergence.py --out benchmarks/results/convergence --plot-only"
    )
    page = (ROOT / "docs" / "convergence.md").read_text()
    section = page[page.index(f"### {task} (") :]
    for link, text in zip(LINKS, expected):
        assert text in section, (
            f"docs/convergence.md, section {task!r}: the {link} table differs from what "
            f"benchmarks/results/convergence/{task}_{link}.json renders:\n{text}"
        )


def _sweep_rows(name: str) -> list[dict]:
    lines = (RESULTS / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.parametrize("name", ("diloco_sweep", "sparse_sweep"))
def test_the_sweep_tables_are_the_ones_sweep_diloco_renders(name: str) -> None:
    from benchmarks.sweep_diloco import HEADER, table

    assert (RESULTS / f"{name}.md").read_text() == HEADER + table(_sweep_rows(name)), (
        f"benchmarks/results/convergence/{name}.md is not what {name}.jsonl renders: run python "
        f"benchmarks/sweep_diloco.py --out benchmarks/results/convergence/{name}.jsonl --table "
        f"benchmarks/results/convergence/{name}.md"
    )


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table_after(page: str, heading: str, first_cell: str) -> list[list[str]]:
    """The body rows of the first Markdown table under ``heading`` whose header starts with ``first_cell``."""
    section = page[page.index(heading) :]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_cell} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def test_the_sweep_rows_selected_on_the_convergence_page_are_rows_of_the_full_table() -> None:
    """docs/convergence.md's sweep table selects rows and columns of ``diloco_sweep.md``: every row it shows
    must be one the renderer gives (task, validation interval, validated model, setting, seeds, losses, the
    ratio with its interval, the window's, and the bytes)."""
    from benchmarks.sweep_diloco import table

    full = table(_sweep_rows("diloco_sweep")).splitlines()[2:]
    projected = set()
    for line in full:
        task, steps, every, validated, setting, seeds, loss, vs, _, _, window, sent, _ = _cells(line)
        task = task if steps == "160" else f"{task}, {steps} steps"
        projected.add((task, every, validated, setting, seeds, loss, vs, window or "-", sent))
    shown = _table_after((ROOT / "docs" / "convergence.md").read_text(), "### The sweep", "task")
    assert len(shown) > 40, "the sweep table on docs/convergence.md lost its rows"
    wrong = [" | ".join(row) for row in shown if tuple(row) not in projected]
    assert not wrong, (
        "docs/convergence.md, section 'The sweep': rows that benchmarks/results/convergence/diloco_sweep.jsonl "
        "does not give (re-render with benchmarks/sweep_diloco.py --table and copy the row):\n"
        + "\n".join(wrong)
    )
