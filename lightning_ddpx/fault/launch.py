"""The supervisor of a fault-tolerant job on one machine: it starts the training processes, hosts the store
they coordinate through (or, on the other machines of a run across machines, connects to it), and starts a
replacement when one of them dies.

The store lives here, not in a training process, because whoever hosts it must outlive every loss: with
torchrun's default (rank 0 hosts the ``TCPStore``), killing rank 0 takes the survivors' coordination down
with it. The supervisor trains nothing, so it has no reason to die with a training process.

Each child runs in its own session (``start_new_session=True``), for two reasons:

- a Ctrl-C in the terminal reaches the supervisor only, which then stops the children in order (SIGTERM,
  :data:`TERMINATE_GRACE_S` seconds, SIGKILL) instead of every process dying at once mid-checkpoint;
- what a child starts (data loader workers, compile workers) is in the child's process group, and dies with
  it when the supervisor kills that group after the child is lost.

What a child finds in its environment (``os.environ``, then the ``env`` given, then these):

========================================  =================================================================
``DDPX_FT_STORE_HOST``                    the store's host (the names: :mod:`lightning_ddpx.fault.launch_env`)
``DDPX_FT_STORE_PORT``                    the store's port
``DDPX_FT_UID``                           unique per child, sortable: ``00000``, ``00001``, ...; replacements
                                          continue the sequence. Across machines the node rank prefixes it:
                                          ``n0-00000``, ``n1-00000``, ...
``DDPX_FT_INITIAL_WORLD_SIZE``            ``world_size`` (the processes of every machine), else ``nproc``
``DDPX_FT_REPLACEMENT``                   ``0`` for the first ``nproc`` children, ``1`` for a replacement
``OMP_NUM_THREADS``                       ``1`` unless already set
========================================  =================================================================

What the supervisor writes in the store (the keys are :data:`KEY_INITIAL_WORLD_SIZE` and its siblings):

===============================  ==========================================================================
``ft/initial_world_size``        the initial world size, set by the hosting supervisor before its first child
``ft/dead/<uid>``                why that child was lost: ``killed by SIGKILL``, ``exit code 3``
``ft/dead_count``                children lost so far (a counter: read it with ``store.add(key, 0)``)
``ft/replacements_started``      replacements started so far (a counter, raised before the replacement starts)
``ft/finished/<uid>``            ``0``: that child exited with code 0
===============================  ==========================================================================

Both counters exist (at 0) before the first child starts, so reading one never waits. Every supervisor of
the run writes its own children's keys, the hosting one and the others alike.

**Across machines** there is one supervisor per machine. The one with ``node_rank=0`` hosts the store at
``host:port`` (it listens on every interface; ``host`` is the address its own children connect to); each
other one (``node_rank`` 1, 2, ...) connects to that store as a client at ``host:port`` and hosts nothing.
Every one is given the run's ``world_size``. When its own children have all exited, the hosting supervisor
keeps the store up until the other machines' processes are done too (:meth:`Supervisor.run`).

WARNING: the hosting supervisor (and its machine) is the one point of failure: if it is SIGKILLed, the store
goes with it and every child on every machine loses its coordination (they are not killed: their sessions are
their own). A supervisor on another machine that loses the store cannot record its children's exits any more;
it says so and goes on until they have exited.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import FrameType

import torch.distributed as dist

from lightning_ddpx.fault.launch_env import ENV_HOST, ENV_INITIAL, ENV_PORT, ENV_REPLACEMENT, ENV_UID
from lightning_ddpx.fault.membership import Generation

__all__ = [
    "KEY_DEAD",
    "KEY_DEAD_COUNT",
    "KEY_FINISHED",
    "KEY_INITIAL_WORLD_SIZE",
    "KEY_REPLACEMENTS_STARTED",
    "Supervisor",
    "exit_reason",
    "main",
]

KEY_INITIAL_WORLD_SIZE = "ft/initial_world_size"
KEY_DEAD = "ft/dead/"  # + uid
KEY_FINISHED = "ft/finished/"  # + uid
KEY_DEAD_COUNT = "ft/dead_count"
KEY_REPLACEMENTS_STARTED = "ft/replacements_started"
# Written by the members (lightning_ddpx.fault.membership): the latest generation's number, then its record.
KEY_LATEST_GEN = "ft/latest_gen"
KEY_GEN_MEMBERS = "ft/gen/{}/members"

TERMINATE_GRACE_S = 10.0  # between SIGTERM and SIGKILL when the supervisor is stopped
# Bounds the supervisor's own store calls (sets and adds: they never wait for a key).
STORE_TIMEOUT = timedelta(seconds=60)
# How long a supervisor on another machine tries to reach node 0's store: the machines may start in any order.
CONNECT_TIMEOUT_S = 120.0
LINGER_S = 600.0  # the default of how long the hosting supervisor waits for the other machines' processes
LINGER_POLL_S = 0.25
_LOG_PREFIX = "lightning_ddpx fault tolerance: "


class Supervisor:
    """Runs ``nproc`` processes of ``command``, hosts their store (or connects to node 0's), and replaces up
    to ``replacements`` of them that die (a non-zero exit code or a signal); :meth:`run` returns when none
    is running.

    On one machine, leave ``world_size`` and ``node_rank`` out. Across machines, give each supervisor the
    run's ``world_size`` (its processes over every machine) and its machine's ``node_rank``: node 0 hosts the
    store at ``host:port``, the others connect to it there (``port`` must then be node 0's, not 0).

    The store is listening (or connected) once the constructor returns (:attr:`port`), and is released when
    :meth:`run` returns: a supervisor runs once.
    """

    def __init__(
        self,
        command: list[str],
        nproc: int,
        replacements: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        env: dict[str, str] | None = None,
        poll_interval_s: float = 0.05,
        log: Callable[[str], None] | None = None,
        *,
        world_size: int | None = None,
        node_rank: int | None = None,
        linger_s: float = LINGER_S,
        not_replaced: Callable[[str], str | None] | None = None,
    ) -> None:
        """``port=0`` picks a free port (on node 0 only). ``env`` is added to each child's environment.
        ``log`` receives one line per event (a start, a loss, a replacement, a stop); by default, stderr.
        ``linger_s`` bounds how long node 0 waits for the other machines' processes (see :meth:`run`).
        ``not_replaced(uid)``, asked when a child was lost: why a replacement would fail the same way (the
        child reported an error of the training code's own, which a replacement would raise again), or
        ``None`` to replace it while replacements are left.
        Raises ``ConnectionError``, naming the address, when node 0's store cannot be reached in
        :data:`CONNECT_TIMEOUT_S` seconds."""
        problem = _problem(command, nproc, replacements, port, world_size, node_rank, linger_s)
        if problem is not None:
            raise ValueError(problem)
        self._command = list(command)
        self._nproc = nproc
        self._world_size = world_size if world_size is not None else nproc
        self._node_rank = node_rank
        self._hosting = not node_rank  # None (one machine) or 0: this supervisor hosts the store
        self._uid_prefix = f"n{node_rank}-" if node_rank is not None else ""
        self._replacements_left = replacements
        self._not_replaced = not_replaced
        self._host = host
        self._env = dict(env or {})
        self._poll_interval_s = poll_interval_s
        self._linger_s = linger_s
        self._log = log if log is not None else _to_stderr
        self._store = self._open_store(host, port)
        self._port: int = self._store.port
        self._running: dict[str, subprocess.Popen] = {}  # uid -> its process
        self._started = 0  # children started so far, replacements included: the next uid
        self._finished = 0  # children that exited with code 0
        self._first_exit_code: int | None = None  # the first non-zero exit code (not a signal)
        # Set by stop() or a signal handler, read by the loop: a plain attribute, because a handler that
        # took a lock (threading.Event.set) could deadlock against the main thread it interrupted.
        self._stop_signal: int | None = None
        self._store_lost = False  # a client that lost node 0's store says so once, then stops writing
        self._generation_seen = 0  # the generations whose left-behind members were looked for
        self.uids_lost: list[str] = []  # children lost, in the order they were found dead

    @property
    def port(self) -> int:
        """The port the store listens on (the one picked when ``port=0`` was given)."""
        return self._port

    def stop(self) -> None:
        """Make :meth:`run` stop the children as for a SIGTERM (and return 143). Safe from any thread."""
        if self._stop_signal is None:
            self._stop_signal = signal.SIGTERM

    def run(self) -> int:
        """Start the children and supervise them until none is running.

        Returns 0 if at least one child exited with code 0, else the first non-zero exit code seen (1 if the
        children were all killed by signals); 130 or 143 when stopped by SIGINT or SIGTERM (or
        :meth:`stop`). Whatever ends it, an exception included, no child is left running and the store is
        released.

        Node 0 of a run across machines then lingers: the other machines' processes still need its store, so
        it returns only once every member of the latest generation has exited -- as its own supervisor
        recorded it, ``ft/finished/<uid>`` or ``ft/dead/<uid>`` -- or after ``linger_s`` seconds, or when
        stopped; its return code is still its children's. It does not go by the members' ``closed`` counter:
        a member counts itself closed before it exits, and its supervisor writes its exit afterwards. Before
        the first generation formed, nothing waits.
        """
        try:
            with self._stop_signals_caught():
                try:
                    self._announce()
                    for _ in range(self._nproc):
                        self._start(replacement=False)
                    code = self._supervise()
                finally:
                    self._kill_running()
                if self._hosting and self._world_size > self._nproc:
                    self._linger()
                return code
        finally:
            del self._store  # the last reference: the server stops (a client disconnects)

    # ----------------------------------------------------------------------------------- the store
    def _open_store(self, host: str, port: int) -> dist.TCPStore:
        """Host the store (one machine, or node 0), or connect to node 0's as a client."""
        if self._hosting:
            return dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT, use_libuv=True
            )
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT_S))
        except dist.DistError as error:
            raise ConnectionError(
                f"{_LOG_PREFIX}node {self._node_rank} could not reach the store at {host}:{port} within "
                f"{CONNECT_TIMEOUT_S:g} s ({_first_line(error)}). Start the launcher with --node-rank 0 on "
                f"the machine at {host} with --port {port}, and check that this machine can reach that "
                "address and port (firewall, the right interface's address)."
            ) from error
        store.set_timeout(STORE_TIMEOUT)
        return store

    def _announce(self) -> None:
        """The hosting supervisor writes the run's first keys; every supervisor says where the store is."""
        address = f"{self._host}:{self._port}"
        starting = (
            f"starting {self._nproc} process(es), {self._replacements_left} replacement(s) allowed"
            if self._node_rank is None
            else f"starting {self._nproc} of the run's {self._world_size} process(es) as node "
            f"{self._node_rank}, {self._replacements_left} replacement(s) allowed"
        )
        if not self._hosting:
            self._log(f"{_LOG_PREFIX}connected to the store at {address} (hosted by node 0); {starting}")
            return
        self._store.set(KEY_INITIAL_WORLD_SIZE, str(self._world_size))
        self._store.add(KEY_DEAD_COUNT, 0)
        self._store.add(KEY_REPLACEMENTS_STARTED, 0)
        self._log(f"{_LOG_PREFIX}store at {address}; {starting}")
        if self._node_rank is not None:
            self._log(
                f"{_LOG_PREFIX}the store listens on port {self._port} of every interface; on each other "
                f"machine run: python -m lightning_ddpx.fault.launch --nproc N --world-size {self._world_size} "
                f"--node-rank R --store <this machine's address>:{self._port} -- COMMAND"
            )

    def _record_exit(self, uid: str, code: int) -> None:
        """``ft/finished/<uid>``, or ``ft/dead/<uid>`` and the dead count. A client whose store is gone (node
        0 returned, or its machine was lost) says so once and records nothing more: nobody could read it."""
        if self._store_lost:
            return
        try:
            if code == 0:
                self._store.set(KEY_FINISHED + uid, "0")
            else:
                self._store.set(KEY_DEAD + uid, exit_reason(code))
                self._store.add(KEY_DEAD_COUNT, 1)
        except dist.DistError as error:
            if self._hosting:
                raise
            self._store_lost = True
            self._log(
                f"{_LOG_PREFIX}the store at {self._host}:{self._port} is gone ({_first_line(error)}): node 0's "
                f"launcher returned or its machine was lost; process {uid}'s exit is not recorded, nor later ones"
            )

    # ------------------------------------------------------------------------------------ the loop
    def _supervise(self) -> int:
        while self._running:
            if self._stop_signal is not None:
                self._terminate_running()
                return 128 + self._stop_signal
            self._stop_left_behind()
            for uid, process in list(self._running.items()):
                if _has_exited(process):
                    self._on_exit(uid, process)
            time.sleep(self._poll_interval_s)
        if self._finished:
            return 0
        return self._first_exit_code if self._first_exit_code is not None else 1

    def _stop_left_behind(self) -> None:
        """Stop a child that the members left out of a newer generation while it is still running: alive but
        stuck outside the steps (a hung data loader) or stopped, it might never come back to learn it, and
        would hold its device and this launcher's exit. Its exit is then recorded as a loss (a replacement
        starts if one is left)."""
        if self._store_lost:
            return
        try:
            if not self._store.check([KEY_LATEST_GEN]):
                return
            latest = int(self._store.get(KEY_LATEST_GEN).decode())
            while self._generation_seen < latest:
                self._generation_seen += 1
                record = Generation.from_json(self._store.get(KEY_GEN_MEMBERS.format(self._generation_seen)))
                for entry in record.lost:
                    uid, _, reason = entry.partition(": ")
                    process = self._running.get(uid)
                    if process is not None and not _has_exited(process):
                        self._log(
                            f"{_LOG_PREFIX}process {uid} (pid {process.pid}) was left behind by the others "
                            f"({reason}); stopping it"
                        )
                        _kill_group(process, signal.SIGKILL)
        except dist.DistError:  # the store is gone: _record_exit says so at the next exit
            return

    def _start(self, replacement: bool) -> str:
        uid = f"{self._uid_prefix}{self._started:05d}"
        self._started += 1
        env = {**os.environ, **self._env}
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            {
                ENV_HOST: self._host,
                ENV_PORT: str(self._port),
                ENV_UID: uid,
                ENV_INITIAL: str(self._world_size),
                ENV_REPLACEMENT: "1" if replacement else "0",
            }
        )
        self._running[uid] = subprocess.Popen(
            self._command, env=env, start_new_session=True, preexec_fn=_die_with_parent
        )
        return uid

    def _on_exit(self, uid: str, process: subprocess.Popen) -> None:
        """Record a child that exited; if it was lost, start its replacement while replacements are left."""
        code = self._reap(uid, process)
        self._record_exit(uid, code)
        if code == 0:
            self._finished += 1
            return
        self.uids_lost.append(uid)
        if code > 0 and self._first_exit_code is None:
            self._first_exit_code = code
        self._log(f"{_LOG_PREFIX}process {uid} (pid {process.pid}) lost: {exit_reason(code)}")
        why = None
        if self._replacements_left == 0 or self._store_lost:
            why = "the store is gone" if self._store_lost else "no replacement left"
        elif self._not_replaced is not None:
            why = self._not_replaced(uid)
        if why is not None:
            self._log(f"{_LOG_PREFIX}{why}; {len(self._running)} process(es) go on")
            return
        self._replacements_left -= 1
        self._store.add(KEY_REPLACEMENTS_STARTED, 1)
        new_uid = self._start(replacement=True)
        self._log(
            f"{_LOG_PREFIX}started process {new_uid} (pid {self._running[new_uid].pid}) to replace {uid}; "
            f"{self._replacements_left} replacement(s) left"
        )

    def _reap(self, uid: str, process: subprocess.Popen) -> int:
        """Kill what is left of an exited child's process group, then reap the child: its exit code.

        The order matters: until it is reaped, the child's pid -- which is its group's id -- cannot be
        reused, so the signal cannot reach an unrelated process group.
        """
        _kill_group(process, signal.SIGKILL)
        del self._running[uid]
        return process.wait()

    # -------------------------------------------------------------------- node 0, after its children
    def _linger(self) -> None:
        """Keep the store up while members on other machines have not exited (see :meth:`run`)."""
        if self._stop_signal is not None:
            return
        deadline = time.monotonic() + self._linger_s
        waiting = self._members_not_exited()
        if waiting:
            self._log(
                f"{_LOG_PREFIX}this machine's processes are done; keeping the store up for {', '.join(waiting)} "
                f"(at most {self._linger_s:g} s)"
            )
        while waiting and self._stop_signal is None:
            if time.monotonic() > deadline:
                self._log(
                    f"{_LOG_PREFIX}{', '.join(waiting)} still not exited after linger_s={self._linger_s:g} s: "
                    "releasing the store (they lose their coordination)"
                )
                return
            time.sleep(LINGER_POLL_S)
            waiting = self._members_not_exited()

    def _members_not_exited(self) -> list[str]:
        """The latest generation's members whose exit no supervisor recorded yet ([] before the first)."""
        if not self._store.check([KEY_LATEST_GEN]):
            return []
        number = int(self._store.get(KEY_LATEST_GEN).decode())
        generation = Generation.from_json(self._store.get(KEY_GEN_MEMBERS.format(number)))
        return [
            uid
            for uid in generation.members
            if not (self._store.check([KEY_DEAD + uid]) or self._store.check([KEY_FINISHED + uid]))
        ]

    # -------------------------------------------------------------------------------- stopping
    def _terminate_running(self) -> None:
        """SIGTERM to every running child's group, up to :data:`TERMINATE_GRACE_S` seconds for them to
        exit, then SIGKILL to the groups still there."""
        self._log(f"{_LOG_PREFIX}stopping: SIGTERM to {len(self._running)} process(es)")
        for process in self._running.values():
            _kill_group(process, signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while self._running and time.monotonic() < deadline:
            for uid, process in list(self._running.items()):
                if _has_exited(process):
                    self._reap(uid, process)
            time.sleep(self._poll_interval_s)
        self._kill_running()

    def _kill_running(self) -> None:
        if not self._running:
            return
        self._log(f"{_LOG_PREFIX}killing {len(self._running)} process(es): {', '.join(self._running)}")
        for process in self._running.values():
            _kill_group(process, signal.SIGKILL)
        for uid, process in list(self._running.items()):
            self._reap(uid, process)

    @contextlib.contextmanager
    def _stop_signals_caught(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the children in order instead of raising in the loop. Python delivers
        signals to the main thread only: from another thread, :meth:`stop` is the way."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum


def _die_with_parent() -> None:
    """In a child, before it runs the command: on Linux, ask the kernel to SIGKILL it when the supervisor
    dies, even by SIGKILL (its own session keeps it out of the supervisor's process group, so nothing else
    would reach it). Elsewhere nothing: the supervisor's own cleanup is all there is."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _has_exited(process: subprocess.Popen) -> bool:
    """Whether the child has exited, without reaping it (``WNOWAIT``: see :meth:`Supervisor._reap`)."""
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(process: subprocess.Popen, signum: int) -> None:
    """Signal the child's process group (its id is the child's pid: the child leads its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def exit_reason(code: int) -> str:
    """``killed by SIGKILL`` for a negative return code (Popen's way of saying "a signal"), else
    ``exit code N`` (the supervisor's log and the membership records; the popen launcher's messages)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _problem(
    command: list[str],
    nproc: int,
    replacements: int,
    port: int,
    world_size: int | None = None,
    node_rank: int | None = None,
    linger_s: float = LINGER_S,
) -> str | None:
    """What is wrong with the arguments, said once for the class and the CLI; ``None`` if nothing."""
    if not command:
        return "the training command is empty: give one, e.g. [sys.executable, 'train.py'] (CLI: -- train.py)"
    if nproc < 1:
        return f"nproc must be at least 1 (the number of training processes to start), got {nproc}"
    if replacements < 0:
        return f"replacements must be 0 or more (0: a lost process is not replaced), got {replacements}"
    if not 0 <= port <= 65535:
        return f"port must be in 0..65535 (0: pick a free port), got {port}"
    if linger_s < 0:
        return f"linger_s must be 0 or more (seconds node 0 waits for the other machines), got {linger_s:g}"
    if world_size is None and node_rank is None:
        return None  # one machine
    if world_size is None or node_rank is None:
        return (
            "world_size and node_rank go together: across machines give each launcher both (the processes "
            f"of every machine, and this machine's rank: 0 hosts the store); got world_size={world_size}, "
            f"node_rank={node_rank}"
        )
    if world_size < nproc:
        return (
            f"world_size counts the processes of every machine, so it must be at least nproc={nproc}, got "
            f"{world_size}"
        )
    if not 0 <= node_rank < world_size:
        return (
            f"node_rank must be in 0..{world_size - 1} (one launcher per machine, each with at least one of the "
            f"world_size={world_size} processes; 0 hosts the store), got {node_rank}"
        )
    if node_rank > 0 and port == 0:
        return (
            f"node_rank {node_rank} connects to the store of node 0: give that store's port (node 0's launcher "
            "prints it), not 0"
        )
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- the CLI
_USAGE = """python -m lightning_ddpx.fault.launch --nproc N [--replacements R] [--host H] [--port P] -- COMMAND ...
  across machines, one launch per machine:
  on the one hosting the store:  ... --nproc N --world-size W --node-rank 0 [--port P] -- COMMAND ...
  on each other machine:         ... --nproc N --world-size W --node-rank R --store HOST:P -- COMMAND ..."""


def main(argv: list[str] | None = None) -> int:
    """The CLI: ``python -m lightning_ddpx.fault.launch --nproc 3 --replacements 1 -- train.py ARG ...``.

    A command whose first word ends with ``.py`` runs with this Python (``sys.executable``); any other
    command runs as given. Returns :meth:`Supervisor.run`'s return code, or 1 when node 0's store cannot be
    reached.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is everything after "--", taken verbatim: its options are the training script's, not ours.
    options, command = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(
        prog="python -m lightning_ddpx.fault.launch",
        usage=_USAGE,
        description="Run a training command on NPROC processes of this machine; a process that dies is "
        "replaced (up to --replacements times) and the others go on. Across machines, run one launcher per "
        "machine: node 0 hosts the store, the others connect to it (--store).",
    )
    parser.add_argument(
        "--nproc", type=int, required=True, help="training processes to start on this machine"
    )
    parser.add_argument("--replacements", type=int, default=0, help="lost processes to replace (default 0)")
    parser.add_argument(
        "--host", help="the address this machine's processes reach the store at (default 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, help="the store's port (default 0: a free one, printed)")
    parser.add_argument(
        "--world-size", type=int, help="across machines: the processes of every machine (default: --nproc)"
    )
    parser.add_argument(
        "--node-rank", type=int, help="across machines: this machine's rank; 0 hosts the store"
    )
    parser.add_argument(
        "--store", metavar="HOST:PORT", help="on a machine of node rank 1 or more: node 0's store"
    )
    parser.add_argument(
        "--linger-s",
        type=float,
        default=LINGER_S,
        help=f"node 0: how long to keep the store up for the other machines' processes after its own are done "
        f"(default {LINGER_S:g})",
    )
    args = parser.parse_args(options)
    problem = _store_problem(args.store, args.host, args.port, args.world_size, args.node_rank)
    host, port = args.host or "127.0.0.1", args.port or 0
    if problem is None and args.store is not None:
        host, port = _address(args.store) or (host, port)
    problem = problem or _problem(
        command, args.nproc, args.replacements, port, args.world_size, args.node_rank, args.linger_s
    )
    if problem is not None:
        parser.error(problem)
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    try:
        supervisor = Supervisor(
            command,
            args.nproc,
            args.replacements,
            host,
            port,
            world_size=args.world_size,
            node_rank=args.node_rank,
            linger_s=args.linger_s,
        )
    except ConnectionError as error:
        _to_stderr(str(error))
        return 1
    return supervisor.run()


def _store_problem(
    store: str | None, host: str | None, port: int | None, world_size: int | None, node_rank: int | None
) -> str | None:
    """What is wrong with ``--store`` among the other flags (the CLI's own rules); ``None`` if nothing."""
    if store is None:
        if node_rank is not None and node_rank > 0:
            return (
                f"--node-rank {node_rank} connects to the store that the launcher with --node-rank 0 hosts: give "
                "--store HOST:PORT (that launcher prints its port)"
            )
        return None
    if world_size is None or node_rank is None:
        return (
            "--store needs --world-size (the processes of every machine) and --node-rank (this machine's: 1, "
            "2, ...)"
        )
    if node_rank == 0:
        return (
            "--node-rank 0 hosts the store (at --host/--port): drop --store there, the other machines give it"
        )
    if host is not None or port is not None:
        return "--store replaces --host and --port on the machines that do not host the store: drop them"
    if _address(store) is None:
        return (
            f"--store must be HOST:PORT, the address of node 0's machine and its store's port (e.g. "
            f"10.0.0.1:29400), got {store!r}"
        )
    return None


def _address(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (or ``[IPV6]:PORT``) as ``(host, port)``; ``None`` if ``text`` is not one."""
    host, _, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return host, int(port)


if __name__ == "__main__":
    sys.exit(main())
