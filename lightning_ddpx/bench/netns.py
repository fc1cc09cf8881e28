"""Two emulated "nodes": Linux network namespaces joined by a veth pair whose rate ``tc`` limits.

Processes on 127.0.0.1 talk at memory speed, which hides what gradient compression buys on a cluster. A
:class:`VethLink` gives two processes each their own network stack, joined by one link of known bandwidth
(and optionally latency), so a two-node job runs over a real TCP path that can also be cut
(:meth:`VethLink.set_link`) to test failure handling. Needs root and iproute2 (``ip``, ``tc``); callers
check :func:`netns_unavailable_reason` first and skip with its message.

Shaping: a token bucket (``tbf``) on the egress of *both* ends, so each direction is limited to ``rate``.
Its burst is :data:`BURST_SECONDS` of traffic (at least :data:`MIN_BURST_BYTES`, enough for one 64 KiB
GSO packet that veth hands over unsegmented) and its queue holds :data:`QUEUE_SECONDS` of traffic: enough
that one TCP stream fills the link (measured with ``benchmarks/link_check.py``, see docs/multinode.md),
small enough that a 50 MB transfer is not mostly queueing delay.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import re
import shutil
import subprocess
import sys
from types import TracebackType

from lightning_ddpx.bench.cleanup import hold_exit_handlers, pid_alive, release_exit_handlers

__all__ = ["VethLink", "netns_unavailable_reason", "remove_stale_namespaces", "parse_rate"]

BURST_SECONDS = 0.002  # tbf bucket: 2 ms of traffic at the rate (250 KB at 1 Gbit/s, 2.5 MB at 10 Gbit/s)
MIN_BURST_BYTES = 128 * 1024  # > one 64 KiB GSO packet, so tbf never has to segment or drop one
QUEUE_SECONDS = 0.02  # tbf queue: 20 ms of traffic; packets beyond that are dropped (TCP backs off)

_RATE_UNITS = {  # tc's rate units (SI prefixes; "bps" is *bytes* per second, as in tc(8))
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}
_COUNTER = itertools.count()
_LIVE: set[VethLink] = set()  # open links, deleted at interpreter exit if the caller never closed them


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as ``"1gbit"``, ``"100mbit"`` or ``"125mbps"`` (bytes/s)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", rate)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"rate={rate!r} is not a tc rate: pass a positive number and one of {sorted(_RATE_UNITS)}, "
            "e.g. rate='1gbit' or rate='10gbit' (or rate=None for an unlimited link)"
        )
    return float(match.group(1)) * _RATE_UNITS[unit]


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"lightning_ddpx.bench.netns: `{' '.join(argv)}` failed (exit {result.returncode}): "
            f"{result.stderr.strip() or result.stdout.strip()}"
        )
    return result


@functools.lru_cache(maxsize=1)
def netns_unavailable_reason() -> str | None:
    """``None`` when namespaces, veth pairs and tc can be used here; otherwise why not (for a skip message).

    Checks the platform, root, the iproute2 tools, and then really creates and deletes a namespace holding
    a veth pair: containers often have the tools but forbid the operations.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH: install iproute2 (apt-get install iproute2)"
    probe = f"ddpxprobe-{os.getpid()}"
    try:
        _run(["ip", "netns", "del", probe], check=False)  # left by a killed process with this pid
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
            _run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit",
                  "burst", "128kb", "latency", "20ms"])  # fmt: skip
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        return f"creating a network namespace with a shaped veth pair is not permitted here: {error}"
    return None


def remove_stale_namespaces(prefix: str = "ddpx") -> list[str]:
    """Delete namespaces ``<prefix>-<pid>-...`` whose creating process is gone (a crashed earlier run).

    Namespaces of live processes are left alone, so parallel runs never delete each other's links.
    Returns the names deleted.
    """
    listing = _run(["ip", "netns", "list"], check=False).stdout
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-\d+-[ab]")
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = pattern.fullmatch(name)
        if match and not pid_alive(int(match.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


class VethLink:
    """Context manager: two network namespaces joined by a veth pair, deleted again on exit (always).

    Node ``i`` lives in ``namespaces[i]`` with interface ``interfaces[i]`` at ``addresses[i]``; ``lo`` is
    up in both. Run a process on a node with :meth:`command` and the environment from :meth:`env`.

    Args:
        rate: tc rate limiting each direction, e.g. ``"1gbit"`` or ``"10gbit"``; ``None``: unlimited.
        delay_ms: one-way delay added with netem on each end (round trip: twice this); 0 for none.
        prefix: start of the namespace names (``<prefix>-<pid>-<n>-a`` / ``-b``); unique per instance.
    """

    def __init__(self, rate: str | None = None, delay_ms: float = 0.0, prefix: str = "ddpx") -> None:
        if rate is not None:
            parse_rate(rate)  # fail here, with the parameter named, not in the middle of set-up
        if delay_ms < 0:
            raise ValueError(f"delay_ms={delay_ms} must be >= 0 (one-way delay in milliseconds)")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,15}", prefix):
            raise ValueError(f"prefix={prefix!r} must be a letter then up to 15 letters, digits or '_'")
        self.rate = rate
        self.delay_ms = float(delay_ms)
        self.prefix = prefix
        index = next(_COUNTER)
        stem = f"{prefix}-{os.getpid()}-{index}"
        self.namespaces: tuple[str, str] = (f"{stem}-a", f"{stem}-b")
        self.interfaces: tuple[str, str] = ("veth0", "veth1")  # names are per namespace: no collisions
        block = (os.getpid() * 131 + index) % (1 << 14)  # a /30 out of 10.213.0.0/16, per instance
        base = f"10.213.{block >> 6}.{(block & 63) * 4}"
        self.addresses: tuple[str, str] = (_offset(base, 1), _offset(base, 2))
        self._created = False
        self._holds_handlers = False

    # ------------------------------------------------------------------------------- life cycle
    def __enter__(self) -> VethLink:
        reason = netns_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"lightning_ddpx.bench.netns: cannot create a VethLink: {reason}")
        remove_stale_namespaces(self.prefix)
        self._created = True
        _LIVE.add(self)
        # SIGTERM and SIGHUP (`timeout`, a CI runner, a closed terminal) exit through Python while the link is
        # open, so the `with` block and the exit handler below delete the namespaces
        self._holds_handlers = hold_exit_handlers()
        try:
            self._create()
        except BaseException:  # Ctrl-C or a failing command half-way: leave nothing behind
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Delete both namespaces (which deletes the veth pair and its qdiscs). Safe to call twice."""
        if not self._created:
            return
        for namespace in self.namespaces:
            _run(["ip", "netns", "del", namespace], check=False)
        self._created = False
        _LIVE.discard(self)
        if self._holds_handlers:
            release_exit_handlers()
            self._holds_handlers = False

    def _create(self) -> None:
        a, b = self.namespaces
        for namespace in self.namespaces:
            _run(["ip", "netns", "del", namespace], check=False)  # a leftover with this very name
            _run(["ip", "netns", "add", namespace])
        _run(["ip", "link", "add", self.interfaces[0], "netns", a, "type", "veth",
              "peer", "name", self.interfaces[1], "netns", b])  # fmt: skip
        for node, namespace in enumerate(self.namespaces):
            _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
            _run(["ip", "-n", namespace, "addr", "add", f"{self.addresses[node]}/30",
                  "dev", self.interfaces[node]])  # fmt: skip
            _run(["ip", "-n", namespace, "link", "set", self.interfaces[node], "up"])
            self._shape(namespace, self.interfaces[node])

    def _shape(self, namespace: str, interface: str) -> None:
        """Egress shaping on one end: netem delay (if any) as root with the tbf rate limit under it."""
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", interface]
        parent = ["root"]
        if self.delay_ms > 0:
            result = _run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms",
                           "limit", "100000"], check=False)  # fmt: skip
            if result.returncode != 0:
                raise RuntimeError(
                    f"lightning_ddpx.bench.netns: delay_ms={self.delay_ms} needs tc's netem qdisc, which failed here "
                    f"({result.stderr.strip()}); load the kernel module sch_netem or pass delay_ms=0"
                )
            parent = ["parent", "1:1"]
        if self.rate is not None:
            bytes_per_s = parse_rate(self.rate) / 8
            burst = max(MIN_BURST_BYTES, int(bytes_per_s * BURST_SECONDS))
            limit = burst + int(bytes_per_s * QUEUE_SECONDS)
            _run([*tc, *parent, "handle", "10:", "tbf", "rate", self.rate, "burst", str(burst),
                  "limit", str(limit)])  # fmt: skip

    # ------------------------------------------------------------------------------------ use
    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace (``ip netns exec``); the environment is inherited."""
        return ["ip", "netns", "exec", self.namespaces[self._check_node(node)], *argv]

    def env(self, node: int) -> dict[str, str]:
        """Variables that make torch.distributed on node ``node`` rendezvous with node 0 over the veth link.

        Add ``MASTER_PORT`` and the ranks (``RANK``/``WORLD_SIZE`` or Lightning's ``NODE_RANK``) yourself.
        """
        interface = self.interfaces[self._check_node(node)]
        return {
            "GLOO_SOCKET_IFNAME": interface,
            "TP_SOCKET_IFNAME": interface,
            "MASTER_ADDR": self.addresses[0],
            # the nodes stand for two machines, which share no memory: every byte must cross the link
            "DDPX_SHARED_MEMORY": "0",
        }

    def set_link(self, up: bool) -> None:
        """Bring both ends of the veth pair down (``up=False``: traffic stops, sockets stay open) or up."""
        for node, namespace in enumerate(self.namespaces):
            _run(["ip", "-n", namespace, "link", "set", self.interfaces[node], "up" if up else "down"])

    def _check_node(self, node: int) -> int:
        if node not in (0, 1):
            raise ValueError(f"node={node} is not a node of this VethLink: use 0 or 1")
        if not self._created:
            raise RuntimeError("this VethLink is not set up: use it inside `with VethLink(...) as link:`")
        return node

    def __repr__(self) -> str:
        return f"VethLink(rate={self.rate!r}, delay_ms={self.delay_ms}, namespaces={self.namespaces})"


def _offset(address: str, n: int) -> str:
    head, last = address.rsplit(".", 1)
    return f"{head}.{int(last) + n}"


@atexit.register
def _close_live_links() -> None:
    """Delete links a caller forgot to close (their namespaces would outlive the process otherwise)."""
    for link in list(_LIVE):
        link.close()
