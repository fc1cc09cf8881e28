"""The documentation: the site builds strictly, the tests it cites exist, and its measured figures are the
ones in the results files they cite."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.dist_utils import run_job


@pytest.mark.processes
def test_mkdocs_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra: pip install -e '.[dev]'")
    done = run_job(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], 120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("strategy", "checkpointing", "hooks"):
        assert (tmp_path / "site" / page / "index.html").exists()
    shutil.rmtree(tmp_path / "site")


def test_the_differences_page_names_tests_that_exist():
    """docs/differences.md backs each row with a test (``file.py::test_name``, or ``::test_name`` after a
    file named earlier in the same cell): every one it names must exist, so a renamed test cannot leave a row
    claiming a proof that is gone."""
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "differences.md").read_text()
    named = []
    for row in page.splitlines():
        current = None
        for file, test in re.findall(r"`(?:([\w/]+\.py))?::(test_\w+)`", row):
            current = file or current
            assert current, f"a test named without its file in: {row[:80]}"
            named.append((current, test))
    assert len(named) > 30
    missing = []
    for file, test in named:
        path = root / "tests" / file
        if not path.exists() or not re.search(rf"^def {test}\(", path.read_text(), re.M):
            missing.append(f"{file}::{test}")
    assert not missing, f"docs/differences.md names tests that do not exist: {missing}"


# ------------------------------------------------------------------------------------ measured figures
# A figure measured by a benchmark is followed, in the Markdown, by a marker naming the results file it came
# from and the key that holds it: ``0.37 s<!-- figure: fault_tolerance.json recovery.summary.kill_to_step_s.median -->``
# (``*1000`` or ``*100`` after the key: the file holds seconds or a fraction, the page ms or %). Markers are
# HTML comments, invisible on the rendered page.
FIGURE = re.compile(
    r"(?<![0-9.])([0-9]+(?:\.[0-9]+)?)(?:\s*(?:x|s|ms|us|%|MiB))?\**\s*<!-- figure: (\S+) (\S+)(?: \*(\S+))? -->"
)
SPREAD_KEYS = (("min", "max"), ("low", "high"), ("ci95.0", "ci95.1"))
PAGES = ("README.md", "docs/benchmarks.md", "docs/fault-tolerance.md")


def _lookup(data: object, key: str) -> object:
    for part in key.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def _sections(text: str) -> list[str]:
    """The page cut at its headings: a figure's command, machine and date are stated once per section."""
    return re.split(r"(?m)^#{1,6} ", text)


def _figures() -> list[tuple[str, str, str, str, str, str | None]]:
    root = Path(__file__).resolve().parents[2]
    found = []
    for page in PAGES:
        for section in _sections((root / page).read_text()):
            for match in FIGURE.finditer(section):
                found.append((page, section, *match.groups()))
    return found


def test_every_measured_figure_is_the_one_in_its_results_json() -> None:
    """The figure on the page equals the value in ``benchmarks/results/<file>`` at the marker's key, to the
    digits printed; the file records the machine (CPU count), the load average and the date; the page's
    section names the command that wrote it, the cores, the load and that date; and a median is quoted with
    its spread (markers to its min and max, or its interval, in the same section)."""
    root = Path(__file__).resolve().parents[2]
    figures = _figures()
    assert len(figures) >= 20, "the measured figures lost their markers"
    wrong = []
    for page, section, shown, file, key, scale in figures:
        results = json.loads((root / "benchmarks" / "results" / file).read_text())
        value = float(_lookup(results, key)) * float(scale or 1)
        digits = len(shown.partition(".")[2])
        if abs(value - float(shown)) > 0.5 * 10**-digits + 1e-12:
            wrong.append(f"{page}: {shown} where {file} {key} holds {value:.{digits + 2}f}")
        environment = results["environment"]
        assert environment["cpu_count"] and environment["loadavg"], f"{file} records no machine or load"
        date = environment["time"][:10]
        heading = section.splitlines()[0][:60]
        for needed, what in ((date, "the date"), ("load", "the load"), ("core", "the cores")):
            if needed not in section:
                wrong.append(f"{page}, section {heading!r}: a figure from {file} without {what} ({needed!r})")
        if not re.search(r"python (?:benchmarks/\w+\.py|-m lightning_ddpx\.bench)", section):
            wrong.append(
                f"{page}, section {heading!r}: a figure from {file} without the command that measured it"
            )
        if key.endswith(".median"):
            parent = key[: -len("median")]
            cited = {k for _, s, _, f, k, _ in figures if s is section and f == file}
            if not any({parent + low, parent + high} <= cited for low, high in SPREAD_KEYS):
                wrong.append(f"{page}: {shown} ({file} {key}) is quoted without its spread")
    assert not wrong, "\n".join(sorted(set(wrong)))


@pytest.mark.processes  # environment_info asks git for the commit
def test_a_benchmark_records_the_command_machine_date_and_load() -> None:
    from benchmarks.common import environment_info

    environment = environment_info()
    assert environment["command"].startswith("python ")
    assert environment["cpu_count"] >= 1 and len(environment["loadavg"]) == 3
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}", environment["time"])
