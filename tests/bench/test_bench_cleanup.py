"""Benchmarks leave nothing behind: stopped with SIGTERM mid-run, or killed by an earlier run.

Each benchmark that creates something outside its process (network namespaces, temporary directories of logs
and checkpoints, child processes) is started at small sizes, stopped with SIGTERM -- as ``timeout``, a CI
runner or a scheduler stops it -- once its ranks run, and must then exit with 128 + SIGTERM and leave no
process it started, no namespace and no file in the temporary directory or ``/dev/shm`` named after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_ddpx.bench.cleanup import exits_through_python, remove_stale_directories, temporary_directory
from lightning_ddpx.bench.netns import netns_unavailable_reason

REPO_ROOT = Path(__file__).resolve().parents[2]
START_LIMIT_S = 240  # ranks importing torch on 2 busy cores
EXIT_LIMIT_S = 60

needs_netns = pytest.mark.skipif(
    netns_unavailable_reason() is not None, reason=f"veth benchmarks: {netns_unavailable_reason()}"
)


# ------------------------------------------------------------------------------------------------- helper
_HOLDS_A_DIRECTORY = """
import sys, time
from lightning_ddpx.bench.cleanup import exits_through_python, temporary_directory
with exits_through_python(), temporary_directory("ddpxtest") as path:
    print(path, flush=True)
    time.sleep(60)
"""


@pytest.mark.processes
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["TERM", "HUP", "INT"])
def test_a_signal_unwinds_and_deletes_the_directory(signum: int) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDS_A_DIRECTORY],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        path = process.stdout.readline().strip()
        assert os.path.isdir(path) and f"ddpxtest-{process.pid}-" in path
        process.send_signal(signum)
        code = process.wait(timeout=EXIT_LIMIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # Ctrl-C: Python unwinds, then ends itself by SIGINT again (the status a shell expects after Ctrl-C)
    assert code == (-signal.SIGINT if signum == signal.SIGINT else 128 + signum)
    assert not os.path.exists(path)


def test_handlers_are_restored_and_a_programs_own_handler_kept() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with exits_through_python():
        assert signal.getsignal(signal.SIGTERM) is not before
        with exits_through_python():  # nested: still held after the inner block
            pass
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before

    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGHUP, own)
    try:
        with exits_through_python():
            assert signal.getsignal(signal.SIGHUP) is own
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.processes
def test_directories_of_dead_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no live process
    stale = tmp_path / f"ddpxtest-{dead.pid}-abc"
    mine = tmp_path / f"ddpxtest-{os.getpid()}-abc"
    other = tmp_path / f"other-{dead.pid}-abc"
    for path in (stale, mine, other):
        path.mkdir()
    assert remove_stale_directories("ddpxtest", str(tmp_path)) == [str(stale)]
    assert not stale.exists() and mine.exists() and other.exists()
    with temporary_directory("ddpxtest", str(tmp_path)) as path:
        assert Path(path).parent == tmp_path and Path(path).name.startswith(f"ddpxtest-{os.getpid()}-")
    assert not os.path.exists(path)


# --------------------------------------------------------------------------------------------- benchmarks
def _children() -> dict[int, list[int]]:
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        by_parent.setdefault(parent, []).append(int(entry))
    return by_parent


def _descendants(pid: int) -> set[int]:
    by_parent, found, todo = _children(), set(), [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.split()}


def _named_after(pids: set[int]) -> list[str]:
    """Entries of the temporary directory and /dev/shm, and namespaces, whose name holds one of ``pids``."""
    names = []
    for directory in (tempfile.gettempdir(), "/dev/shm"):
        names += (
            [os.path.join(directory, n) for n in os.listdir(directory)] if os.path.isdir(directory) else []
        )
    if netns_unavailable_reason() is None:
        names += [f"netns:{n}" for n in _namespaces()]
    marks = {f"-{pid}-" for pid in pids} | {f"_{pid}_" for pid in pids}
    return [n for n in names if any(m in os.path.basename(n) for m in marks)]


def _stop_mid_run(argv: list[str], running: Callable[[set[int]], bool], tmp_path: Path) -> None:
    """Start ``argv``, SIGTERM it once ``running(its live descendants' pids)`` holds, check what is left."""
    log = open(tmp_path / "benchmark.log", "w")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            live = {p for p in _descendants(process.pid) if _alive(p)}
            seen |= live
            if running(live):
                break
            assert process.poll() is None, f"the benchmark ended before it was stopped:\n{_log(tmp_path)}"
            assert time.monotonic() < deadline, (
                f"its ranks did not start in {START_LIMIT_S} s:\n{_log(tmp_path)}"
            )
            time.sleep(0.2)
        seen |= _descendants(process.pid)
        process.send_signal(signal.SIGTERM)  # to the benchmark only, as `timeout` sends it
        code = process.wait(timeout=EXIT_LIMIT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
    left = sorted(p for p in seen if _alive(p))
    for pid in left:  # don't leave them to the next test either
        os.kill(pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM, f"exit code {code}:\n{_log(tmp_path)}"
    assert not left, f"processes left running: {[(p, _cmdline(p)) for p in left]}"
    assert not _named_after({process.pid, *seen}), _named_after({process.pid, *seen})


def _log(tmp_path: Path) -> str:
    return (tmp_path / "benchmark.log").read_text()[-3000:]


def _with(*parts: str) -> Callable[[set[int]], bool]:
    """True once two live descendants' command lines contain each of ``parts``, and 3 s later."""
    since: list[float] = []

    def running(live: set[int]) -> bool:
        ranks = [p for p in live if all(part in _cmdline(p) for part in parts)]
        if len(ranks) < 2:
            return False
        since.append(time.monotonic())
        return time.monotonic() - since[0] > 3.0

    return running


@pytest.mark.processes
def test_bench_engine_stopped_by_sigterm_leaves_nothing(tmp_path: Path) -> None:
    script = str(REPO_ROOT / "benchmarks" / "bench_engine.py")
    argv = [sys.executable, script, "--models", "tiny", "--steps", "1000000", "--quiet"]
    _stop_mid_run(argv, _with("benchmarks.rank_worker"), tmp_path)


@needs_netns
@pytest.mark.processes
def test_bench_convergence_over_a_veth_link_stopped_by_sigterm_leaves_nothing(tmp_path: Path) -> None:
    script = str(REPO_ROOT / "benchmarks" / "bench_convergence.py")
    argv = [sys.executable, script, "--tasks", "digits", "--links", "100mbit", "--hooks", "allreduce",
            "--out", str(tmp_path / "out"), "--img", str(tmp_path / "img")]  # fmt: skip
    _stop_mid_run(argv, _with("convergence_worker"), tmp_path)


@pytest.mark.processes
def test_bench_fault_tolerance_stopped_by_sigterm_leaves_nothing(tmp_path: Path) -> None:
    script = str(REPO_ROOT / "benchmarks" / "bench_fault_tolerance.py")
    argv = [sys.executable, script, "--quick", "--sections", "overhead", "--steps", "100000"]
    _stop_mid_run(argv, _with("fault_bench_job"), tmp_path)


@pytest.mark.processes
def test_bench_fault_quality_stopped_by_sigterm_leaves_nothing(tmp_path: Path) -> None:
    script = str(REPO_ROOT / "benchmarks" / "bench_fault_quality.py")
    argv = [sys.executable, script, "--quick", "--steps", "100000", "--json", str(tmp_path / "q.json")]
    _stop_mid_run(argv, _with("fault_quality_job"), tmp_path)
