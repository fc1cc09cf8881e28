"""The supervisor of a fault-tolerant job on one machine: it starts the training processes, hosts the store
they coordinate through, and starts a replacement when one of them dies.

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
                                          continue the sequence
``DDPX_FT_INITIAL_WORLD_SIZE``            ``nproc``
``DDPX_FT_REPLACEMENT``                   ``0`` for the first ``nproc`` children, ``1`` for a replacement
``OMP_NUM_THREADS``                       ``1`` unless already set
========================================  =================================================================

What the supervisor writes in the store (the keys are :data:`KEY_INITIAL_WORLD_SIZE` and its siblings):

===============================  ==========================================================================
``ft/initial_world_size``        ``nproc``, set before the first child starts
``ft/dead/<uid>``                why that child was lost: ``killed by SIGKILL``, ``exit code 3``
``ft/dead_count``                children lost so far (a counter: read it with ``store.add(key, 0)``)
``ft/replacements_started``      replacements started so far (a counter, raised before the replacement starts)
``ft/finished/<uid>``            ``0``: that child exited with code 0
===============================  ==========================================================================

Both counters exist (at 0) before the first child starts, so reading one never waits.

WARNING: one machine only, and the supervisor is the one process that must not die: if it is SIGKILLed, the
store goes with it and the children lose their coordination (they are not killed: their sessions are their
own).
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

__all__ = [
    "KEY_DEAD",
    "KEY_DEAD_COUNT",
    "KEY_FINISHED",
    "KEY_INITIAL_WORLD_SIZE",
    "KEY_REPLACEMENTS_STARTED",
    "Supervisor",
    "main",
]

KEY_INITIAL_WORLD_SIZE = "ft/initial_world_size"
KEY_DEAD = "ft/dead/"  # + uid
KEY_FINISHED = "ft/finished/"  # + uid
KEY_DEAD_COUNT = "ft/dead_count"
KEY_REPLACEMENTS_STARTED = "ft/replacements_started"

TERMINATE_GRACE_S = 10.0  # between SIGTERM and SIGKILL when the supervisor is stopped
# Bounds the supervisor's own store calls (sets and adds: they never wait for a key).
STORE_TIMEOUT = timedelta(seconds=60)
_LOG_PREFIX = "lightning_ddpx fault tolerance: "


class Supervisor:
    """Runs ``nproc`` processes of ``command``, hosts their store, and replaces up to ``replacements`` of
    them that die (a non-zero exit code or a signal); :meth:`run` returns when none is running.

    The store is listening once the constructor returns (:attr:`port`), and is released when :meth:`run`
    returns: a supervisor runs once.
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
    ) -> None:
        """``port=0`` picks a free port. ``env`` is added to each child's environment. ``log`` receives one
        line per event (a start, a loss, a replacement, a stop); by default it goes to stderr."""
        problem = _problem(command, nproc, replacements, port)
        if problem is not None:
            raise ValueError(problem)
        self._command = list(command)
        self._nproc = nproc
        self._replacements_left = replacements
        self._host = host
        self._env = dict(env or {})
        self._poll_interval_s = poll_interval_s
        self._log = log if log is not None else _to_stderr
        self._store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT, use_libuv=True
        )
        self._port: int = self._store.port
        self._running: dict[str, subprocess.Popen] = {}  # uid -> its process
        self._started = 0  # children started so far, replacements included: the next uid
        self._finished = 0  # children that exited with code 0
        self._first_exit_code: int | None = None  # the first non-zero exit code (not a signal)
        # Set by stop() or a signal handler, read by the loop: a plain attribute, because a handler that
        # took a lock (threading.Event.set) could deadlock against the main thread it interrupted.
        self._stop_signal: int | None = None
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
        """
        try:
            with self._stop_signals_caught():
                try:
                    self._store.set(KEY_INITIAL_WORLD_SIZE, str(self._nproc))
                    self._store.add(KEY_DEAD_COUNT, 0)
                    self._store.add(KEY_REPLACEMENTS_STARTED, 0)
                    self._log(
                        f"{_LOG_PREFIX}store at {self._host}:{self._port}; starting {self._nproc} "
                        f"process(es), {self._replacements_left} replacement(s) allowed"
                    )
                    for _ in range(self._nproc):
                        self._start(replacement=False)
                    return self._supervise()
                finally:
                    self._kill_running()
        finally:
            del self._store  # the last reference: the server stops

    # ------------------------------------------------------------------------------------ the loop
    def _supervise(self) -> int:
        while self._running:
            if self._stop_signal is not None:
                self._terminate_running()
                return 128 + self._stop_signal
            for uid, process in list(self._running.items()):
                if _has_exited(process):
                    self._on_exit(uid, process)
            time.sleep(self._poll_interval_s)
        if self._finished:
            return 0
        return self._first_exit_code if self._first_exit_code is not None else 1

    def _start(self, replacement: bool) -> str:
        uid = f"{self._started:05d}"
        self._started += 1
        env = {**os.environ, **self._env}
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            {
                ENV_HOST: self._host,
                ENV_PORT: str(self._port),
                ENV_UID: uid,
                ENV_INITIAL: str(self._nproc),
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
        if code == 0:
            self._finished += 1
            self._store.set(KEY_FINISHED + uid, "0")
            return
        reason = _reason(code)
        self._store.set(KEY_DEAD + uid, reason)
        self._store.add(KEY_DEAD_COUNT, 1)
        self.uids_lost.append(uid)
        if code > 0 and self._first_exit_code is None:
            self._first_exit_code = code
        self._log(f"{_LOG_PREFIX}process {uid} (pid {process.pid}) lost: {reason}")
        if self._replacements_left == 0:
            self._log(f"{_LOG_PREFIX}no replacement left; {len(self._running)} process(es) go on")
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


def _reason(code: int) -> str:
    """``killed by SIGKILL`` for a negative return code (Popen's way of saying "a signal"), else
    ``exit code N``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _problem(command: list[str], nproc: int, replacements: int, port: int) -> str | None:
    """What is wrong with the arguments, said once for the class and the CLI; ``None`` if nothing."""
    if not command:
        return "the training command is empty: give one, e.g. [sys.executable, 'train.py'] (CLI: -- train.py)"
    if nproc < 1:
        return f"nproc must be at least 1 (the number of training processes to start), got {nproc}"
    if replacements < 0:
        return f"replacements must be 0 or more (0: a lost process is not replaced), got {replacements}"
    if not 0 <= port <= 65535:
        return f"port must be in 0..65535 (0: pick a free port), got {port}"
    return None


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- the CLI
_USAGE = (
    "python -m lightning_ddpx.fault.launch --nproc N [--replacements R] [--host H] [--port P] -- COMMAND ..."
)


def main(argv: list[str] | None = None) -> int:
    """The CLI: ``python -m lightning_ddpx.fault.launch --nproc 3 --replacements 1 -- train.py ARG ...``.

    A command whose first word ends with ``.py`` runs with this Python (``sys.executable``); any other
    command runs as given. Returns :meth:`Supervisor.run`'s return code.
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
        "replaced (up to --replacements times) and the others go on.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="training processes to start")
    parser.add_argument("--replacements", type=int, default=0, help="lost processes to replace (default 0)")
    parser.add_argument("--host", default="127.0.0.1", help="the store's address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="the store's port (default 0: a free one)")
    args = parser.parse_args(options)
    problem = _problem(command, args.nproc, args.replacements, args.port)
    if problem is not None:
        parser.error(problem)
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    return Supervisor(command, args.nproc, args.replacements, args.host, args.port).run()


if __name__ == "__main__":
    sys.exit(main())
