"""The documentation: the site builds strictly, the tests it cites exist, and its measured figures are the
ones in the results files they cite."""

from __future__ import annotations

import functools
import json
import re
import shutil
import sys
from collections import defaultdict
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
# (``*1000`` or ``*100`` after the key: the file holds seconds or a fraction, the page ms or %; ``*-100``: a
# negative fraction the page words as "below"). Markers are HTML comments, invisible on the rendered page.
# Keys: dict keys and list indices separated by dots; in a list of records, a record's ``name`` or ``id``
# selects it; ``min``, ``max``, ``median`` and ``mean`` of a list of numbers are computed; ``[...]`` quotes a
# part that holds dots (a DiLoCo setting's name). Two kinds of file are read through their benchmark's own
# code, so a figure is what that code gives from the committed runs: ``convergence/<task>_<link>.json``
# (``rows`` summarised again, by contender name; ``first_rows`` with the first of two runs) and the sweeps'
# ``.jsonl`` (``[setting id].field``, each setting's summary; ``[id@0-19]`` over those seeds only).
FIGURE = re.compile(
    r"(?<![0-9.,])((?:(?<=[\s(*[])[+-])?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?)(?:\s*(?:x|s|ms|us|µs|%|MiB|MB|kB))?\**\s*"
    r"<!-- figure: (\S+) (\S+)(?: \*(\S+))? -->"
)
MEDIAN_SPREADS = (("min", "max"), ("low", "high"), ("ci95.0", "ci95.1"))
RATIO_SPREADS = (
    ("ratio_se",),
    ("low", "high"),
    ("ratio_ci_low", "ratio_ci_high"),
    ("ratio_p25", "ratio_p75"),
)
COMMAND = re.compile(r"python (?:benchmarks/\w+\.py|-m lightning_ddpx\.bench)")
# Results written before the benchmarks recorded their environment (command, CPU count, load, date): the page
# must still state the cores, the load and a date for their figures, from the runs' notes (each convergence
# run holds its own 1-minute load, ``loadavg_1min``), but the file cannot confirm the date.
UNRECORDED = {
    f"convergence/{name}"
    for name in (
        *(
            f"{task}_{link}.json"
            for task in ("digits", "pydoc-lm")
            for link in ("loopback", "1gbit", "100mbit")
        ),
        "diloco_sweep.jsonl",
        "sparse_sweep.jsonl",
    )
}
MARKER = re.compile(r"(?<!`)<!-- figure:")  # a marker quoted in backticks is an example, not a figure
ROOT = Path(__file__).resolve().parents[2]


def _pages() -> list[str]:
    """README.md and every docs page with a marker: a page gets checked by citing its first figure."""
    pages = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")))]
    return [page for page in pages if MARKER.search((ROOT / page).read_text())]


def _key_parts(key: str) -> list[str]:
    return [quoted or plain for quoted, plain in re.findall(r"\[([^\]]+)\]|([^.\[\]]+)", key)]


def _lookup(data: object, key: str) -> object:
    for part in _key_parts(key):
        if isinstance(data, list) and part in ("min", "max", "median", "mean"):
            values = sorted(float(v) for v in data)
            middle = len(values) // 2
            data = {
                "min": values[0],
                "max": values[-1],
                "mean": sum(values) / len(values),
                "median": values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2,
            }[part]
        elif isinstance(data, list):
            data = (
                data[int(part)]
                if part.lstrip("-").isdigit()
                else next(r for r in data if part in (r.get("name"), r.get("id")))
            )
        else:
            data = data[part]
    return data


@functools.cache
def _results(file: str) -> dict:
    """The results a marker cites, as the benchmark's own code reads them."""
    path = ROOT / "benchmarks" / "results" / file
    if path.suffix == ".jsonl":
        return {"rows": [json.loads(line) for line in path.read_text().splitlines() if line.strip()]}
    results = json.loads(path.read_text())
    if file.startswith("convergence/") and "runs" in results:
        from benchmarks.bench_convergence import link_report
        from lightning_ddpx.bench.convergence import TOLERANCE, rows_as_json

        results["rows"] = rows_as_json(link_report(results, None, TOLERANCE)[1])
        if "first_runs" in results:  # contenders run twice: their first runs against the same others
            first = {**results, "runs": {**results["runs"], **results["first_runs"]}}
            results["first_rows"] = rows_as_json(link_report(first, None, TOLERANCE)[1])
    return results


@functools.cache
def _sweep_setting(file: str, ident: str) -> dict:
    """A sweep setting's summary (``benchmarks.sweep_diloco.summaries``) by its id; ``id@0-19`` or ``id@0,2``
    summarises those seeds only, as the page quotes a subset."""
    from benchmarks.sweep_diloco import summaries

    name, _, seeds = ident.partition("@")
    rows = _results(file)["rows"]
    if seeds:
        first, _, last = seeds.partition("-")
        wanted = set(range(int(first), int(last) + 1)) if last else {int(x) for x in seeds.split(",")}
        rows = [row for row in rows if row.get("seed", 0) in wanted]
    return next(summary for summary in summaries(rows) if summary["id"] == name)


def _has_spread(file: str, parent: str) -> bool:
    for keys in RATIO_SPREADS:
        try:
            if _value(file, parent + keys[0]) is not None:
                return True
        except (KeyError, IndexError, StopIteration, TypeError):
            pass
    return False


def _value(file: str, key: str) -> object:
    """What a marker's key holds; a sweep's key is ``[setting id].field``."""
    if file.endswith(".jsonl"):
        ident, _, rest = key.partition("].")
        return _lookup(_sweep_setting(file, ident.removeprefix("[")), rest)
    return _lookup(_results(file), key)


def _sections(text: str) -> list[str]:
    """The page cut at its headings (not at a shell comment in a code block): a figure's command, machine and
    date are stated once per section."""
    sections, lines, fenced = [], [], False
    for line in text.splitlines(keepends=True):
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            sections.append("".join(lines))
            lines = [line.lstrip("#").lstrip()]
        else:
            lines.append(line)
    return [*sections, "".join(lines)]


def _figures(page: str, text: str) -> list[tuple[str, str, str, str, str, str | None]]:
    return [
        (page, section, *match.groups()) for section in _sections(text) for match in FIGURE.finditer(section)
    ]


def _problems(figures: list[tuple[str, str, str, str, str, str | None]]) -> list[str]:
    """What is wrong with each figure: its value against its file, what its section fails to state, a median
    or a ratio over seeds quoted without its spread. Each names the page, the section and the figure."""
    wrong = []
    unstated: dict[tuple[str, str, str, str], list[str]] = defaultdict(list)  # said once per section
    for page, section, shown, file, key, scale in figures:
        heading = section.splitlines()[0][:60] if section.strip() else "(top)"
        where = f"{page}, section {heading!r}, figure {shown} ({file} {key})"
        results = _results(file)
        try:
            value = float(_value(file, key)) * float(scale or 1)
        except (KeyError, IndexError, StopIteration, TypeError, ValueError) as error:
            wrong.append(f"{where}: the key holds no number ({type(error).__name__}: {error})")
            continue
        digits = len(shown.partition(".")[2])
        if abs(value - float(shown.replace(",", ""))) > 0.5 * 10**-digits + 1e-12:
            wrong.append(f"{where}: the file holds {value:.{digits + 2}f}")
        environment = results.get("environment")
        if environment is None:
            if file not in UNRECORDED:
                wrong.append(f"{where}: {file} records no environment (command, cores, load, date)")
            date = re.search(r"\d{4}-\d\d-\d\d", section)
            date = date.group() if date else "a date (YYYY-MM-DD)"
        else:
            assert environment["cpu_count"] and environment["loadavg"], f"{file} records no machine or load"
            date = environment["time"][:10]
        for needed, what in ((date, "the date"), ("load", "the load"), ("core", "the cores")):
            if needed not in section:
                unstated[(page, heading, file, f"does not state {what} ({needed!r})")].append(shown)
        if not COMMAND.search(section):
            unstated[(page, heading, file, "does not name the command that measured it")].append(shown)
        cited = {k for _, s, _, f, k, _ in figures if s is section and f == file}
        for ending, spreads in ((".median", MEDIAN_SPREADS), (".ratio", RATIO_SPREADS)):
            if not key.endswith(ending):
                continue
            parent = key[: -len(ending) + 1]
            if ending == ".ratio" and not _has_spread(file, parent):
                continue  # one seed, or a file that records no spread for it: none to give
            if not any(all(parent + k in cited for k in keys) for keys in spreads):
                wrong.append(
                    f"{where}: quoted without its spread ({' or '.join('+'.join(k) for k in spreads)})"
                )
    for (page, heading, file, problem), shown in unstated.items():
        wrong.append(
            f"{page}, section {heading!r}, figures {', '.join(shown[:6])} ({file}): the section {problem}"
        )
    return sorted(set(wrong))


def test_every_measured_figure_is_the_one_in_its_results_json() -> None:
    """The figure on the page equals the value in ``benchmarks/results/<file>`` at the marker's key, to the
    digits printed; the file records the machine (CPU count), the load average and the date; the page's
    section names the command that wrote it, the cores, the load and that date; and a median, or a ratio over
    several seeds, is quoted with its spread (markers to its min and max, its interval or its standard
    error, in the same section)."""
    figures, wrong = [], []
    for page in _pages():
        text = (ROOT / page).read_text()
        found = _figures(page, text)
        if len(found) != len(MARKER.findall(text)):  # name the lines whose markers were not read
            for line in text.splitlines():
                if len(MARKER.findall(line)) != len(FIGURE.findall(line)):
                    wrong.append(f"{page}: a marker not right after its figure, or malformed: {line[:120]}")
        figures += found
    assert len(figures) >= 20, "the measured figures lost their markers"
    wrong += _problems(figures)
    assert not wrong, "\n".join(wrong)


def test_a_figure_that_is_not_its_files_value_is_named() -> None:
    """The check fails on a figure changed by one digit, and says where: page, section and figure."""
    page = (
        "## Recovery\n\nMeasured by `python benchmarks/bench_fault_tolerance.py` on 2 cores, 2026-12-02, "
        "load 0.5: 0.43 s<!-- figure: fault_tolerance.json heal.heal_s -->.\n"
    )
    assert _problems(_figures("page.md", page)) == [], "the right figure was refused"
    wrong = _problems(_figures("page.md", page.replace("0.43 s", "0.44 s")))
    assert len(wrong) == 1 and wrong[0].startswith(
        "page.md, section 'Recovery', figure 0.44 (fault_tolerance.json"
    )
    unstated = _problems(_figures("page.md", page.replace("2026-12-02", "a day")))
    assert unstated == [
        "page.md, section 'Recovery', figures 0.43 (fault_tolerance.json): the section does not state the date "
        "('2026-12-02')"
    ]


@pytest.mark.processes  # environment_info asks git for the commit
def test_a_benchmark_records_the_command_machine_date_and_load() -> None:
    from benchmarks.common import environment_info

    environment = environment_info()
    assert environment["command"].startswith("python ")
    assert environment["cpu_count"] >= 1 and len(environment["loadavg"]) == 3
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}", environment["time"])
