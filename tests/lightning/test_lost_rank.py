"""A rank lost without fault tolerance, under Lightning's popen launcher (the user's process is rank 0 and
starts rank 1): the output of the process the user started names the lost rank, its process and its
signal, that process exits non-zero, and the run leaves nothing behind -- no process, no /dev/shm file, no
listening port.

The issue this guards against was intermittent: Lightning's own launcher SIGKILLed every process, the
user's included, from a thread that wakes every 5 s, and in 2 of 6 runs before any error was printed. So
the kill repeats: ``CI_RUNS`` runs in the normal suite (each victim in forward, backward and the optimizer
step), ``DDPX_LOST_RANK_RUNS=20`` for the full check by hand (later cycles through Fabric as well)::

    DDPX_LOST_RANK_RUNS=20 OMP_NUM_THREADS=1 python -m pytest -q tests/lightning/test_lost_rank.py -k repeated -s

Each run is one real job (tests/jobs/lost_rank_job.py) started as a user starts it, in a session of its own;
whatever happens, that session is SIGKILLed at the end.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

from lightning_ddpx.lightning.processes.popen_launcher import LOSS_GRACE_S, describe_end
from lightning_ddpx.lightning.settings.config import FABRIC_STRATEGY_NAMES, TRAINER_STRATEGY_NAMES
from tests.dist_utils import REPO_ROOT, free_port, job_env
from tests.jobs.lost_rank_job import PHASES

RUNS_ENV = "DDPX_LOST_RANK_RUNS"
CI_RUNS = 6  # both victims in each of the three phases
RUNS = int(os.environ.get(RUNS_ENV, CI_RUNS))
JOB_TIMEOUT_S = 120  # one run: two processes starting torch and Lightning on a loaded 2-core machine
AFTER_KILL_S = LOSS_GRACE_S + 12  # from the kill to the user's process's exit, a loaded machine included


def popen_names(names: tuple[tuple[str, str, dict], ...]) -> list[str]:
    return [name for name, _, params in names if params.get("start_method", "popen") == "popen"]


# ---------------------------------------------------------------------------------- in this process
def test_an_end_is_described_by_exit_code_or_signal_name() -> None:
    assert describe_end(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_end(-signal.SIGSEGV) == "was killed by SIGSEGV"
    assert describe_end(1) == "exited with code 1"


@pytest.mark.parametrize("name", popen_names(TRAINER_STRATEGY_NAMES))
def test_every_trainer_popen_name_uses_our_launcher(name: str) -> None:
    from lightning.pytorch import Trainer

    from lightning_ddpx.lightning.processes.popen_launcher import PopenLauncher

    trainer = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert type(trainer.strategy.launcher) is PopenLauncher, name


@pytest.mark.parametrize("name", popen_names(FABRIC_STRATEGY_NAMES))
def test_every_fabric_popen_name_uses_our_launcher(name: str) -> None:
    from lightning.fabric import Fabric

    from lightning_ddpx.lightning.processes.popen_launcher import FabricPopenLauncher

    fabric = Fabric(accelerator="cpu", devices=2, strategy=name)
    assert type(fabric.strategy.launcher) is FabricPopenLauncher, name


def test_spawn_keeps_lightnings_launcher() -> None:
    from lightning.pytorch import Trainer

    from lightning_ddpx.lightning.processes.popen_launcher import PopenLauncher

    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddpx_spawn", logger=False)
    assert not isinstance(trainer.strategy.launcher, PopenLauncher)


# --------------------------------------------------------------------------------------- real jobs
@dataclass
class Run:
    victim: int
    phase: str
    api: str
    returncode: int
    output: str
    pids: dict[int, int]  # rank -> pid, as each printed it
    seconds_after_kill: float  # from the victim's kill to the exit of the user's process
    leftovers: list[str]  # processes, /dev/shm files or a listening port the run left


def cases(runs: int) -> list[tuple[int, str, str]]:
    """Rank 1 and rank 0 in turn, in forward, backward and the step; the Trainer, then Fabric every other
    cycle of six."""
    return [
        (1 - i % 2, PHASES[(i // 2) % len(PHASES)], "fabric" if (i // 6) % 2 else "trainer")
        for i in range(runs)
    ]


def _session_processes(session: int) -> list[str]:
    """Living processes (not zombies: their parent collects them) of the session ``session`` leads."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 3 and int(fields[3]) == session and fields[0] != "Z":
            found.append(f"process {entry} (state {fields[0]})")
    return found


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _mapped(name: str) -> bool:
    """Whether a living process maps ``/dev/shm/name``: after the run, none of the run's can."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/maps") as maps:
                if f"/dev/shm/{name}" in maps.read():
                    return True
        except OSError:
            continue
    return False


def run_once(victim: int, phase: str, api: str) -> Run:
    port = free_port()
    shm_before = _dev_shm()
    env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "tests.jobs.lost_rank_job", str(victim), phase, api]
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        leftovers: list[str] = []
        try:
            returncode = process.wait(timeout=JOB_TIMEOUT_S)  # collects it at once, as a shell does
            ended = time.time()
            deadline = time.monotonic() + LOSS_GRACE_S + 5  # a surviving child stops within the grace
            while _session_processes(process.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            leftovers += _session_processes(process.pid)
        except subprocess.TimeoutExpired:
            returncode, ended = -999, time.time()
            leftovers.append(f"the run was still going after {JOB_TIMEOUT_S} s")
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait(timeout=30)
        output.seek(0)
        text = output.read()
    if _listening(port):
        leftovers.append(f"port {port} still listening")
    new_shm = _dev_shm() - shm_before
    if new_shm:  # other tests on this machine make some (multiprocessing's semaphores), mapped while in use
        time.sleep(1.0)
        leftovers += [f"/dev/shm/{name}" for name in sorted(new_shm & _dev_shm()) if not _mapped(name)]
    pids = {int(rank): int(pid) for rank, pid in re.findall(r"\bpid (\d) (\d+)", text)}
    killed = re.search(r"\bkilling \d (\d+\.\d{3})", text)
    after = ended - float(killed.group(1)) if killed else float("nan")
    return Run(victim, phase, api, returncode, text, pids, after, leftovers)


def problems(run: Run) -> list[str]:
    """What is wrong with one run (empty: nothing)."""
    where = f"rank {run.victim} killed in {run.phase} ({run.api})"
    found = []
    if set(run.pids) != {0, 1} or not re.search(r"\bkilling \d", run.output):
        return [f"{where}: the run did not reach the kill:\n{run.output[-3000:]}"]
    lost = run.pids[run.victim]
    named = re.search(rf"lightning_ddpx: rank {run.victim} \(process {lost}\b[^\n]*SIGKILL", run.output)
    if named is None:
        found.append(f"{where}: no message names rank {run.victim}, process {lost} and SIGKILL")
    survivor = 1 - run.victim
    if f"lightning_ddpx (rank {survivor}): the other rank (rank {run.victim})" not in run.output:
        found.append(f"{where}: the survivor's own error (rank {survivor}) was not printed")
    if run.victim == 1 and "; then it was killed by SIGKILL" not in run.output:  # not waited out for 1 s
        found.append(f"{where}: rank 0's failure report did not learn of the loss from its launcher")
    if "Forcefully terminating" in run.output:
        found.append(f"{where}: Lightning's own observer acted")
    if run.returncode == 0:
        found.append(f"{where}: the user's process exited with 0")
    if not run.seconds_after_kill < AFTER_KILL_S:
        found.append(f"{where}: the user's process ended {run.seconds_after_kill:.1f} s after the kill")
    found += [f"{where}: left behind: {leftover}" for leftover in run.leftovers]
    if found:
        found.append(f"{where}: output:\n{run.output[-3000:]}")
    return found


def check(runs: list[Run]) -> None:
    failures = [problem for run in runs for problem in problems(run)]
    exact = sum(1 for run in runs if re.search(r"was killed by SIGKILL", run.output))
    summary = (
        f"{len(runs) - len({id(r) for r in runs if problems(r)})} of {len(runs)} runs clean; exit statuses "
        f"{sorted(r.returncode for r in runs)}; {exact} named the signal exactly; seconds from kill to exit: "
        f"{', '.join(f'{r.seconds_after_kill:.1f}' for r in runs)}"
    )
    print(summary)
    assert not failures, summary + "\n" + "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(60 + 40 * RUNS)
@pytest.mark.processes
def test_a_repeated_kill_is_named_every_time() -> None:
    check([run_once(*case) for case in cases(RUNS)])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.processes
def test_fabric_names_a_lost_child() -> None:
    check([run_once(1, "backward", "fabric")])
