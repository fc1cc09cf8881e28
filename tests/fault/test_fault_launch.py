"""The fault-tolerance supervisor (lightning_ddpx/fault/launch.py): what its children find (environment, store),
what it records when one dies, when it replaces one, its return code, and that it leaves no process behind
(stopped from another thread, by SIGTERM, or by an exception in its loop).

The children are small ``python -c`` scripts; only those that talk to the store import torch, to keep the
file fast. Each writes what it saw to ``<tmp>/<uid>.json``, because the store is gone once ``run()``
returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_ddpx.fault import launch
from lightning_ddpx.fault.launch import Supervisor, main
from tests.dist_utils import REPO_ROOT, job_env

# Every child script starts with this: who it is, and where to write what it saw.
PRELUDE = """
import json, os, signal, subprocess, sys, time
from pathlib import Path
uid, out = os.environ["DDPX_FT_UID"], Path(sys.argv[1])
replacement = os.environ["DDPX_FT_REPLACEMENT"] == "1"

def connect():
    from datetime import timedelta
    import torch.distributed as dist
    host, port = os.environ["DDPX_FT_STORE_HOST"], int(os.environ["DDPX_FT_STORE_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))

def report(**seen):
    (out / f"{uid}.tmp").write_text(json.dumps(seen))
    (out / f"{uid}.tmp").rename(out / f"{uid}.json")  # whole or absent
"""


def _child(script: str, directory: Path) -> list[str]:
    return [sys.executable, "-c", PRELUDE + script, str(directory)]


def two_nodes(
    script: str, tmp_path: Path, linger_s: float
) -> tuple[Supervisor, list[str], Supervisor, list[str]]:
    """Two supervisors of one process each, emulating two machines: node 0 hosts the store, node 1 uses it;
    each with the list its log lines go to."""
    lines0: list[str] = []
    lines1: list[str] = []
    node0 = Supervisor(
        _child(script, tmp_path), nproc=1, world_size=2, node_rank=0, linger_s=linger_s, log=lines0.append
    )
    node1 = Supervisor(
        _child(script, tmp_path), nproc=1, port=node0.port, world_size=2, node_rank=1, log=lines1.append
    )
    return node0, lines0, node1, lines1


def _reports(directory: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` is gone (or a zombie waiting for init to reap it: an orphan grandchild), waiting a
    little for the kernel to finish a kill."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, IndexError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _wait_for(paths: list[Path], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not written within {within_s} s: {paths}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------ what children find
@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.processes
def test_children_get_distinct_uids_the_store_and_the_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each child reaches the supervisor's store, sees the others' keys there, and finds its environment."""
    script = """
store = connect()
store.set(f"test/hello/{uid}", str(os.getpid()))
store.wait([f"test/hello/{u:05d}" for u in range(3)])  # every child can read every other's key
report(
    env={k: v for k, v in os.environ.items() if k.startswith("DDPX_FT_") or k in ("OMP_NUM_THREADS", "EXTRA")},
    initial=store.get("ft/initial_world_size").decode(),
    dead_count=int(store.add("ft/dead_count", 0)),
    hellos=sorted(store.get(f"test/hello/{u:05d}").decode() for u in range(3)),
)
"""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the supervisor's default applies
    lines: list[str] = []
    supervisor = Supervisor(_child(script, tmp_path), nproc=3, env={"EXTRA": "x"}, log=lines.append)
    assert supervisor.run() == 0
    reports = _reports(tmp_path)
    assert sorted(reports) == ["00000", "00001", "00002"]
    for uid, seen in reports.items():
        assert seen["env"] == {
            "DDPX_FT_STORE_HOST": "127.0.0.1",
            "DDPX_FT_STORE_PORT": str(supervisor.port),
            "DDPX_FT_UID": uid,
            "DDPX_FT_INITIAL_WORLD_SIZE": "3",
            "DDPX_FT_REPLACEMENT": "0",
            "OMP_NUM_THREADS": "1",
            "EXTRA": "x",
        }
        assert seen["initial"] == "3" and seen["dead_count"] == 0
        assert len(set(seen["hellos"])) == 3
    assert supervisor.uids_lost == []
    assert "starting 3 process(es)" in lines[0]


# ---------------------------------------------------------------------------------- losses, replacements
@pytest.mark.timeout(60)
@pytest.mark.processes
def test_a_killed_child_is_recorded_and_replaced(tmp_path: Path) -> None:
    """SIGKILLed, the child is marked dead in the store, its process group is killed, and the replacement
    (the next uid) finds the marks; the run succeeds because the others finished with 0."""
    script = """
if uid == "00001":  # what it started dies with it (its process group)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    report(pids=[grandchild.pid])
    os.kill(os.getpid(), signal.SIGKILL)
if replacement:  # what the store said when the replacement started
    store = connect()
    report(
        dead=store.get("ft/dead/00001").decode(),
        dead_count=int(store.add("ft/dead_count", 0)),
        replacements_started=int(store.add("ft/replacements_started", 0)),
    )
else:
    report()
"""
    lines: list[str] = []
    supervisor = Supervisor(_child(script, tmp_path), nproc=3, replacements=1, log=lines.append)
    assert supervisor.run() == 0  # the others finished with 0
    reports = _reports(tmp_path)
    assert sorted(reports) == ["00000", "00001", "00002", "00003"]
    assert _gone(reports["00001"]["pids"][0])
    assert reports["00003"] == {"dead": "killed by SIGKILL", "dead_count": 1, "replacements_started": 1}
    assert supervisor.uids_lost == ["00001"]
    lost = [line for line in lines if "lost" in line]
    assert len(lost) == 1 and lost[0].startswith("lightning_ddpx fault tolerance: process 00001 (pid ")
    assert lost[0].endswith(") lost: killed by SIGKILL")
    assert any("started process 00003" in line and "replace 00001" in line for line in lines)


@pytest.mark.timeout(60)
@pytest.mark.processes
def test_no_replacement_without_replacements_left(tmp_path: Path) -> None:
    script = """
if uid == "00001":
    os.kill(os.getpid(), signal.SIGKILL)
report()
"""
    lines: list[str] = []
    supervisor = Supervisor(_child(script, tmp_path), nproc=2, log=lines.append)
    assert supervisor.run() == 0
    assert sorted(_reports(tmp_path)) == ["00000"]
    assert supervisor.uids_lost == ["00001"]
    assert any("no replacement left" in line for line in lines)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "replacements", "expected"),
    [("sys.exit(3)", 1, 3), ("os.kill(os.getpid(), signal.SIGKILL)", 0, 1)],
    ids=["exit-code", "signals-only"],
)
@pytest.mark.processes
def test_all_children_failing_fails_the_run(
    tmp_path: Path, how: str, replacements: int, expected: int
) -> None:
    """The first non-zero exit code, or 1 when only signals ended them; replacements fail too."""
    supervisor = Supervisor(_child(how, tmp_path), nproc=2, replacements=replacements, log=lambda line: None)
    assert supervisor.run() == expected
    assert sorted(supervisor.uids_lost) == [f"{u:05d}" for u in range(2 + replacements)]


# -------------------------------------------------------------------------------- nothing left behind
PIDS_THEN_SLEEP = """
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the SIGKILL after the grace period ends it
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in the child's group
report(pids=[os.getpid(), grandchild.pid])
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.processes
def test_stop_from_another_thread_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Children ignoring SIGTERM are SIGKILLed after the grace period, with what they started."""
    monkeypatch.setattr(launch, "TERMINATE_GRACE_S", 0.5)
    supervisor = Supervisor(_child(PIDS_THEN_SLEEP, tmp_path), nproc=2, log=lambda line: None)

    def stop_when_started() -> None:
        _wait_for([tmp_path / "00000.json", tmp_path / "00001.json"])
        supervisor.stop()

    stopper = threading.Thread(target=stop_when_started, daemon=True)
    stopper.start()
    started = time.monotonic()
    assert supervisor.run() == 143
    assert time.monotonic() - started < 20
    stopper.join(timeout=5)
    pids = [pid for seen in _reports(tmp_path).values() for pid in seen["pids"]]
    assert len(pids) == 4
    assert [pid for pid in pids if not _gone(pid)] == []


@pytest.mark.timeout(60)
@pytest.mark.processes
def test_an_exception_in_the_loop_leaves_no_process(tmp_path: Path) -> None:
    script = """
if uid == "00000":
    while not (out / "00001.json").exists():  # fail once the other child is up
        time.sleep(0.02)
    sys.exit(3)
report(pids=[os.getpid()])
time.sleep(60)
"""

    def log(line: str) -> None:
        if "lost" in line:
            raise RuntimeError("the log failed")

    supervisor = Supervisor(_child(script, tmp_path), nproc=2, log=log)
    with pytest.raises(RuntimeError, match="the log failed"):
        supervisor.run()
    (pid,) = _reports(tmp_path)["00001"]["pids"]
    assert _gone(pid)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.processes
def test_the_cli_forwards_sigterm(tmp_path: Path) -> None:
    """The CLI runs a ``.py`` command with this Python; SIGTERM to it stops the children (which exit at once
    on SIGTERM here) and returns 143."""
    script = tmp_path / "child.py"
    script.write_text(PRELUDE + "report(pids=[os.getpid()])\ntime.sleep(60)\n")
    argv = [
        sys.executable,
        "-m",
        "lightning_ddpx.fault.launch",
        "--nproc",
        "2",
        "--",
        str(script),
        str(tmp_path),
    ]
    cli = subprocess.Popen(
        argv, cwd=REPO_ROOT, env=job_env(), stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _wait_for([tmp_path / "00000.json", tmp_path / "00001.json"])
        cli.send_signal(signal.SIGTERM)
        _, stderr = cli.communicate(timeout=8)  # under the 10 s grace: the children did not need SIGKILL
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
    assert cli.returncode == 143, stderr
    assert "stopping: SIGTERM to 2 process(es)" in stderr
    pids = [pid for seen in _reports(tmp_path).values() for pid in seen["pids"]]
    assert len(pids) == 2 and [pid for pid in pids if not _gone(pid)] == []


# ----------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0", "--", "train.py"], "nproc must be at least 1"),
        (["--nproc", "2", "--replacements", "-1", "--", "train.py"], "replacements must be 0 or more"),
        (["--nproc", "2", "--port", "70000", "--", "train.py"], "port must be in 0..65535"),
        (["--nproc", "2"], "the training command is empty"),
        (["--nproc", "2", "--"], "the training command is empty"),
        (["--", "train.py"], "the following arguments are required: --nproc"),
        (["--nproc", "two", "--", "train.py"], "invalid int value: 'two'"),
    ],
)
def test_cli_argument_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_constructor_checks_its_arguments_before_opening_the_store() -> None:
    with pytest.raises(ValueError, match="nproc must be at least 1"):
        Supervisor([sys.executable, "train.py"], nproc=0, port=-1)
    with pytest.raises(ValueError, match="replacements must be 0 or more"):
        Supervisor([sys.executable, "train.py"], nproc=1, replacements=-1)
    with pytest.raises(ValueError, match="training command is empty"):
        Supervisor([], nproc=1)


# ------------------------------------------------------------------------------------- across machines
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "1", "--store", "10.0.0.1:29400"], "--store needs --world-size"),
        (["--nproc", "1", "--world-size", "3", "--store", "10.0.0.1:29400"], "--store needs --world-size"),
        (
            ["--nproc", "1", "--world-size", "3", "--node-rank", "3", "--store", "h:1"],
            "node_rank must be in 0..2",
        ),
        (["--nproc", "1", "--world-size", "3", "--node-rank", "-1"], "node_rank must be in 0..2"),
        (["--nproc", "1", "--world-size", "3", "--node-rank", "1"], "give --store HOST:PORT"),
        (["--nproc", "1", "--world-size", "3", "--node-rank", "0", "--store", "h:1"], "drop --store there"),
        (
            ["--nproc", "1", "--world-size", "3", "--node-rank", "1", "--store", "h:1", "--port", "2"],
            "drop them",
        ),
        (["--nproc", "3", "--world-size", "2", "--node-rank", "0"], "at least nproc=3, got 2"),
        (["--nproc", "1", "--world-size", "3"], "world_size and node_rank go together"),
        (["--nproc", "1", "--node-rank", "0"], "world_size and node_rank go together"),
        (["--nproc", "1", "--world-size", "2", "--node-rank", "0", "--linger-s", "-1"], "linger_s must be"),
    ],
)
def test_cli_multi_machine_argument_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--", "train.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("store", ["10.0.0.1", "10.0.0.1:", ":29400", "host:port", "host:70000", "host:0"])
def test_cli_refuses_a_bad_store_address(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--nproc", "1", "--world-size", "2", "--node-rank", "1", "--store", store, "--", "train.py"])
    assert "--store must be HOST:PORT, the address of node 0's machine and its store's port" in (
        capsys.readouterr().err
    )
    assert launch._address("[::1]:29400") == ("::1", 29400) and launch._address("a.b:1") == ("a.b", 1)


def test_the_constructor_checks_the_multi_machine_arguments() -> None:
    with pytest.raises(
        ValueError, match="node_rank 1 connects to the store of node 0: give that store's port"
    ):
        Supervisor([sys.executable, "train.py"], nproc=1, world_size=2, node_rank=1, port=0)
    with pytest.raises(ValueError, match="node_rank must be in 0..1"):
        Supervisor([sys.executable, "train.py"], nproc=1, world_size=2, node_rank=2, port=1)


@pytest.mark.timeout(60)
def test_an_unreachable_store_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens at the address: the error names it, after the connect timeout."""
    from tests.dist_utils import free_port

    monkeypatch.setattr(launch, "CONNECT_TIMEOUT_S", 1.0)
    port = free_port()
    with pytest.raises(
        ConnectionError, match=f"node 1 could not reach the store at 127.0.0.1:{port} within 1 s"
    ):
        Supervisor([sys.executable, "train.py"], nproc=1, world_size=2, node_rank=1, port=port)
    argv = ["--nproc", "1", "--world-size", "2", "--node-rank", "1", "--store", f"127.0.0.1:{port}"]
    assert main([*argv, "--", "train.py"]) == 1
    assert f"could not reach the store at 127.0.0.1:{port}" in capsys.readouterr().err


# The first generation's record, as the members would write it (lightning_ddpx.fault.membership).
MEMBERS = """
def form_generation(store, members):
    record = {"number": 1, "members": members, "previous": [], "joiners_consumed": len(members),
              "reason": "start", "lost": []}
    store.set("ft/gen/1/members", json.dumps(record))
    store.set("ft/latest_gen", "1")
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.processes
def test_node_0_keeps_the_store_up_until_the_other_machines_processes_exit(tmp_path: Path) -> None:
    """Two supervisors on one store: node-prefixed uids, the run's world size, node 1's loss recorded in
    node 0's store by node 1's supervisor, and node 0 returning only after that (its own child exited long
    before)."""
    script = (
        MEMBERS
        + """
store = connect()
env = {k: v for k, v in os.environ.items() if k in ("DDPX_FT_UID", "DDPX_FT_INITIAL_WORLD_SIZE")}
if uid == "n0-00000":
    form_generation(store, ["n0-00000", "n1-00000"])
    report(env=env)
else:
    store.wait(["ft/latest_gen"])
    time.sleep(2)  # node 0's child is gone by now: the store must still be there
    report(env=env, late=int(store.add("test/late", 1)))  # an add raises if the store is gone
    os.kill(os.getpid(), signal.SIGKILL)
"""
    )
    node0, lines0, node1, lines1 = two_nodes(script, tmp_path, linger_s=30)
    codes: dict[str, int] = {}
    thread = threading.Thread(target=lambda: codes.update(node1=node1.run()), daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        assert node0.run() == 0
        assert time.monotonic() - started < 25  # it waited for the exit, not for linger_s
    finally:
        node1.stop()
        thread.join(timeout=30)
    assert codes == {"node1": 1}  # its only process was killed
    reports = _reports(tmp_path)
    assert reports["n0-00000"]["env"] == {"DDPX_FT_UID": "n0-00000", "DDPX_FT_INITIAL_WORLD_SIZE": "2"}
    assert reports["n1-00000"] == {
        "env": {"DDPX_FT_UID": "n1-00000", "DDPX_FT_INITIAL_WORLD_SIZE": "2"},
        "late": 1,
    }
    assert "--world-size 2 --node-rank R --store <this machine's address>:" in lines0[1]
    assert any("keeping the store up for n1-00000" in line for line in lines0)
    assert not any("still not exited" in line for line in lines0)
    assert f"connected to the store at 127.0.0.1:{node0.port}" in lines1[0]
    assert any("process n1-00000 (pid" in line and "lost: killed by SIGKILL" in line for line in lines1)
    assert node1.uids_lost == ["n1-00000"]


@pytest.mark.timeout(60)
@pytest.mark.processes
def test_node_0_releases_the_store_after_linger_s_and_node_1_goes_on_without_it(tmp_path: Path) -> None:
    """Node 1's process outlives node 0's linger: node 0 returns after ``linger_s``; node 1's supervisor
    cannot record the exit any more, says so, and still returns its process's code. (The process fails: a
    lost store shows on the dead count's ``add``; a ``set`` is sent without waiting for a reply.)"""
    script = (
        MEMBERS
        + """
store = connect()
if uid == "n0-00000":
    form_generation(store, ["n0-00000", "n1-00000"])
else:
    store.wait(["ft/latest_gen"])
    while not (out / "go").exists():  # written once node 0 returned
        time.sleep(0.05)
    sys.exit(3)
"""
    )
    node0, lines0, node1, lines1 = two_nodes(script, tmp_path, linger_s=0.5)
    codes: dict[str, int] = {}
    thread = threading.Thread(target=lambda: codes.update(node1=node1.run()), daemon=True)
    thread.start()
    try:
        assert node0.run() == 0
        (tmp_path / "go").write_text("")
        thread.join(timeout=30)
    finally:
        node1.stop()
        thread.join(timeout=30)
    assert codes == {"node1": 3}
    assert any(
        "n1-00000 still not exited after linger_s=0.5 s: releasing the store" in line for line in lines0
    )
    assert any(
        f"the store at 127.0.0.1:{node0.port} is gone" in line and "n1-00000's exit is not recorded" in line
        for line in lines1
    )
