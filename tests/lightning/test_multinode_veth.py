"""Two nodes over a real network path: one process in each of two network namespaces joined by veth.

Each process runs tests/jobs/veth_node.py (a Lightning fit with ``DDPXStrategy``, ``num_nodes=2, devices=1``)
with node 0's veth address as ``MASTER_ADDR`` and its own ``NODE_RANK``, as a two-node job is launched on a
cluster. The tests prove that rendezvous, gloo and the gradient reduction work across the link (the result
equals single-process training on the union of both nodes' batches), and that cutting the link makes both
nodes fail with lightning_ddpx's timeout message within the strategy's timeout instead of hanging.
Needs root and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_ddpx.bench.netns import VethLink, netns_unavailable_reason, parse_rate, remove_stale_namespaces
from tests.strategy_helpers import BATCH_SIZE, TinyRegressor, dataset

needs_netns = pytest.mark.skipif(
    netns_unavailable_reason() is not None, reason=f"two-node veth tests: {netns_unavailable_reason()}"
)

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = REPO_ROOT / "tests" / "jobs" / "veth_node.py"
MASTER_PORT = "29431"  # the namespaces are fresh: nothing else listens there
STEPS = 6
TIMEOUT_S = 8  # DDPXStrategy(timeout=...) in the link-failure test
START_LIMIT_S = 120  # two processes importing Lightning on 2 busy cores, then a few steps
EXIT_MARGIN_S = 20  # after the timeout fires: Lightning's exception handling and interpreter exit


def start_nodes(link: VethLink, out: Path, *extra: str) -> list[subprocess.Popen]:
    procs = []
    for node in (0, 1):
        env = {
            **os.environ,
            **link.env(node),
            "MASTER_PORT": MASTER_PORT,
            "NODE_RANK": str(node),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO_ROOT),
            "TORCH_CPP_LOG_LEVEL": "ERROR",  # no reverse-DNS warnings for the veth addresses
        }
        for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "SLURM_JOB_ID", "SLURM_NTASKS"):
            env.pop(name, None)  # only NODE_RANK: the multi-node launch under test
        argv = [sys.executable, str(NODE_SCRIPT), "--out", str(out), "--steps", str(STEPS), *extra]
        procs.append(
            subprocess.Popen(
                link.command(node, argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for both nodes (together at most ``timeout`` s); kill leftovers; return their output."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            outputs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def single_process_reference(steps: int) -> dict[str, torch.Tensor]:
    """Mean allreduce over 2 ranks == one process stepping on both ranks' batches of each step together.

    Lightning gives each rank a ``DistributedSampler(shuffle=True, seed=0)`` in training: rebuild both.
    """
    seed_everything(0, verbose=False)
    model = TinyRegressor()
    optimizer = model.configure_optimizers()
    data = dataset()
    orders = [
        list(DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)) for rank in (0, 1)
    ]
    for step in range(steps):
        batch = [i for order in orders for i in order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]]
        x, y = data[batch]
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def in_namespace(namespace: str, tool: str, *argv: str) -> str:
    return subprocess.run([tool, "-n", namespace, *argv], capture_output=True, text=True, check=True).stdout


def sent_bytes(link: VethLink, node: int) -> int:
    """Bytes node ``node`` sent through its end of the veth pair."""
    stats = json.loads(
        in_namespace(link.namespaces[node], "ip", "-s", "-j", "link", "show", link.interfaces[node])
    )
    return stats[0]["stats64"]["tx"]["bytes"]


def test_parse_rate_reads_tc_units() -> None:
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("10gbit") == 1e10
    assert parse_rate("250mbit") == 250e6
    assert parse_rate("125mbps") == 1e9  # tc: "bps" is bytes per second
    for bad in ("1gb", "fast", "0gbit", "-1gbit"):
        with pytest.raises(ValueError, match="is not a tc rate.*rate='1gbit'"):
            parse_rate(bad)


def test_veth_link_checks_arguments_before_touching_the_system() -> None:
    with pytest.raises(ValueError, match="rate='1 gigabit'"):
        VethLink(rate="1 gigabit")
    with pytest.raises(ValueError, match="delay_ms=-1"):
        VethLink(delay_ms=-1)
    with pytest.raises(ValueError, match="prefix="):
        VethLink(prefix="bad-prefix")
    with pytest.raises(RuntimeError, match="inside `with VethLink"):
        VethLink().env(0)


@needs_netns
@pytest.mark.processes
def test_veth_link_creates_shaped_pair_and_always_deletes_it() -> None:
    first, second = VethLink(rate="1gbit", prefix="ddpxtest"), VethLink(prefix="ddpxtest")
    assert set(first.namespaces).isdisjoint(second.namespaces)
    assert set(first.addresses).isdisjoint(second.addresses)
    with pytest.raises(KeyboardInterrupt):
        with first, second:
            assert set(first.namespaces) | set(second.namespaces) <= namespaces()
            for node in (0, 1):
                namespace, interface = first.namespaces[node], first.interfaces[node]
                assert f"inet {first.addresses[node]}/30" in in_namespace(
                    namespace, "ip", "addr", "show", interface
                )
                assert "tbf" in in_namespace(namespace, "tc", "qdisc", "show", "dev", interface)
                assert "UP" in in_namespace(namespace, "ip", "link", "show", "lo")
            assert "tbf" not in in_namespace(second.namespaces[0], "tc", "qdisc", "show", "dev", "veth0")
            first.set_link(False)
            assert "state DOWN" in in_namespace(first.namespaces[1], "ip", "link", "show", "veth1")
            first.set_link(True)
            assert first.env(1)["MASTER_ADDR"] == first.addresses[0]
            assert first.command(1, ["true"])[:4] == ["ip", "netns", "exec", first.namespaces[1]]
            raise KeyboardInterrupt  # Ctrl-C inside the block: both links must still go
    assert not (set(first.namespaces) | set(second.namespaces)) & namespaces()


_HOLDS_A_LINK = """
import subprocess, sys, time
from lightning_ddpx.bench.netns import VethLink
with VethLink(prefix="ddpxtest") as link:
    child = subprocess.Popen(link.command(0, ["sleep", "60"]))
    print(" ".join(link.namespaces), child.pid, flush=True)
    try:
        time.sleep(60)
    finally:
        child.kill()
        child.wait()
"""


@needs_netns
@pytest.mark.processes
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_process_stopped_by_a_signal_deletes_its_links(signum: int) -> None:
    """As ``timeout`` or a CI runner stops a benchmark: the signal exits through Python, so the ``with``
    block and the exit handler delete both namespaces (and the benchmark's own ``finally`` its children)."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDS_A_LINK], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        *names, child = process.stdout.readline().split()
        assert set(names) <= namespaces(), names
        process.send_signal(signum)
        assert process.wait(timeout=30) == 128 + signum
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert not set(names) & namespaces(), f"left behind: {set(names) & namespaces()}"
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split()[2]


@needs_netns
@pytest.mark.processes
def test_leftover_namespace_of_a_dead_process_is_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no live process (pid reuse within the test is vanishingly unlikely)
    stale = f"ddpxtest-{dead.pid}-0-a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    mine = f"ddpxtest-{os.getpid()}-999-a"  # a live process's namespace: never touched
    subprocess.run(["ip", "netns", "add", mine], check=True)
    try:
        assert remove_stale_namespaces("ddpxtest") == [stale]
        assert stale not in namespaces() and mine in namespaces()
    finally:
        for name in (stale, mine):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_netns
@pytest.mark.slow
@pytest.mark.processes
def test_two_nodes_train_over_veth_like_one_process(tmp_path: Path) -> None:
    with VethLink(rate="1gbit") as link:
        procs = start_nodes(link, tmp_path)
        outputs = finish(procs, START_LIMIT_S)
        sent = [sent_bytes(link, node) for node in (0, 1)]
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {rank} failed:\n{outputs[rank][-4000:]}"
    gradient_bytes = 4 * sum(p.numel() for p in TinyRegressor().parameters())
    assert min(sent) > STEPS * gradient_bytes, sent  # every step's gradients crossed the veth link
    infos = [json.loads((tmp_path / f"info-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, info in enumerate(infos):
        assert info == {
            "global_rank": rank,
            "world_size": 2,
            "node_rank": rank,
            "cluster_environment": "LightningEnvironment",
            "global_step": STEPS,
        }
    params = [torch.load(tmp_path / f"params-{rank}.pt", weights_only=True) for rank in (0, 1)]
    for name in params[0]:
        torch.testing.assert_close(params[1][name], params[0][name], rtol=0, atol=0, msg=name)
    reference = single_process_reference(STEPS)
    assert reference.keys() == params[0].keys()
    for name, value in reference.items():
        torch.testing.assert_close(params[0][name], value, rtol=1e-5, atol=1e-6, msg=name)


@needs_netns
@pytest.mark.slow
@pytest.mark.processes
def test_cut_link_fails_both_nodes_with_timeout_message(tmp_path: Path) -> None:
    with VethLink() as link:
        procs = start_nodes(link, tmp_path, "--pause-after", "3", "--timeout-s", str(TIMEOUT_S))
        try:
            deadline = time.monotonic() + START_LIMIT_S
            while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
                crashed = [proc.poll() for proc in procs if proc.poll() is not None]
                assert not crashed and time.monotonic() < deadline, finish(procs, 1)
                time.sleep(0.05)
            link.set_link(False)
            cut, cut_wall = time.monotonic(), time.time()
            (tmp_path / "go").write_text("")
            outputs = finish(procs, TIMEOUT_S + EXIT_MARGIN_S)
            exited_after = time.monotonic() - cut
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 3, f"node {rank} exit {proc.returncode}:\n{outputs[rank][-4000:]}"
        error = json.loads((tmp_path / f"error-{rank}.json").read_text())
        message = error["message"]
        assert error["type"] == "CommunicationError", error
        assert message.startswith(f"lightning_ddpx (rank {rank}): no peer answered"), message
        assert "while waiting for bucket" in message, message
        assert f"after {TIMEOUT_S} s" in message and "timeout=datetime.timedelta" in message, message
        # It is the strategy's timeout that ended the wait: not before it, and not much after.
        assert TIMEOUT_S - 0.5 < error["time"] - cut_wall < TIMEOUT_S + EXIT_MARGIN_S, (
            error["time"] - cut_wall
        )
    assert exited_after < TIMEOUT_S + EXIT_MARGIN_S, exited_after
