"""Lightning's ``popen`` launcher -- the user's process is rank 0 and starts the others -- naming a lost
process before anything is killed.

Lightning's launcher checks its children from a thread every 5 s; when one has died it SIGKILLs every
process, its own included, and says so at INFO level, which a default run does not show. When that check
falls before the survivors' own error is raised and printed (rank 0's failure report takes about a second),
the user sees no error at all, only a process killed by SIGKILL. Ours starts the same children the same way
(:func:`~lightning_ddpx.lightning._compat.start_children`) and differs in what happens when one is lost:

- rank 0 waits on each child (a thread per child, blocked in ``waitpid``); the moment one ends with a
  non-zero status it says on stderr which rank and process it was and how it ended (its exit code or the
  signal's name), and tells the progress board (:func:`~lightning_ddpx.engine.agreement.progress_board.note_lost`),
  so that rank 0's own failure report does not wait for the lost rank's final record, which never comes;
- the survivors then get :data:`LOSS_GRACE_S` to raise and print their own named error and exit; whatever
  is still running after it is SIGKILLed, this process included: Lightning's launcher's ending and exit
  status (-9), only later;
- each child watches rank 0 through a link: an abstract Unix socket, which has no file and is closed by the
  kernel when rank 0 ends. Rank 0 says goodbye on it when it exits through Python (an error it printed, or
  success), so a link closed without goodbye means rank 0 was killed. The child then says so, with the
  signal when rank 0's exit status can still be read (``/proc``, before rank 0's parent collects it),
  reports its own error and stops within :data:`LOSS_GRACE_S`, so nothing is left behind.

A child ending with 0 is no loss (a rank may finish first); nor are the ends that the launcher itself
causes (``kill``: Ctrl-C, SIGTERM forwarded by the Trainer). Fault-tolerant runs have their own launcher
(:mod:`lightning_ddpx.lightning.fault_tolerance.launch`).
"""

from __future__ import annotations

import atexit
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from typing_extensions import override

from lightning_ddpx.engine.agreement.progress_board import note_lost
from lightning_ddpx.fault.launch import exit_reason
from lightning_ddpx.lightning import _compat as lightning_compat

__all__ = ["LINK_ENV", "LOSS_GRACE_S", "FabricPopenLauncher", "PopenLauncher", "describe_end"]

# How long the survivors of a lost process get to raise, print and exit with their own error: rank 0's
# arrives about 0.1 s after the loss (its failure report no longer waits for the lost rank), a child's at
# once; the rest is room for a survivor that was computing, not communicating, when the loss came.
LOSS_GRACE_S = 3.0
# Set by rank 0 while it starts its children: "<rank 0's pid>:<the link's abstract socket name>".
LINK_ENV = "LIGHTNING_DDPX_LAUNCH_LINK"
_GOODBYE = b"bye"
_POLL_S = 0.05
_STOP_SIGNAL = getattr(signal, "SIGKILL", signal.SIGTERM)  # Lightning's: SIGTERM only where no SIGKILL
_WITHOUT_PYTHON_EXIT = (
    "ended without exiting through Python, so a signal it cannot handle ended it: SIGKILL (kill -9, the "
    "out-of-memory killer) unless it crashed"
)


def describe_end(status: int) -> str:
    """How a process ended, from its return code as ``subprocess`` gives it (negative: the signal), as the
    verb of a sentence: "was killed by SIGKILL", "exited with code 1"."""
    return f"was {exit_reason(status)}" if status < 0 else f"exited with code {status}"


class PopenLauncher(lightning_compat.TrainerSubprocessLauncher):
    """The Trainer's popen launcher with a lost process named first (module docstring)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._observer = _start(self) or getattr(self, "_observer", None)  # a second fit keeps the first's
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        observer: Optional[_ChildObserver] = getattr(self, "_observer", None)
        if observer is not None:
            observer.stop_quietly()  # the ends this causes are no losses
        super().kill(signum)


class FabricPopenLauncher(lightning_compat.FabricSubprocessLauncher):
    """Fabric's popen launcher with a lost process named first (module docstring)."""

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        self._observer = _start(self) or getattr(self, "_observer", None)
        return function(*args, **kwargs)


def _start(launcher: Any) -> Optional[_ChildObserver]:
    """What Lightning's ``launch`` does before calling the function, with our observer and link; returns
    the observer in the process that started the children (``None`` elsewhere)."""
    environment = launcher.cluster_environment
    environment.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    first_rank = environment.node_rank() * launcher.num_processes  # this machine's local rank 0
    observer = None
    if environment.creates_processes_externally:
        _ParentWatch.start_if_linked(first_rank, first_rank + environment.local_rank())
    else:
        link = _Link.open(launcher.num_processes - 1)
        os.environ[LINK_ENV] = link.address
        try:
            lightning_compat.start_children(launcher)
        finally:
            os.environ.pop(LINK_ENV, None)  # the children have their copies; nothing else should inherit it
        observer = _ChildObserver(launcher.procs, first_rank, link)
    lightning_compat.set_threads_per_process(launcher.num_processes)
    return observer


def _say(text: str) -> None:
    """One line on stderr, in one write: the processes of the run share the stream."""
    stream = sys.stderr
    if stream is not None:
        try:
            stream.write(f"lightning_ddpx: {text}\n")
            stream.flush()
        except (OSError, ValueError):  # a closed stream: nothing to tell it
            pass


def _stop_now(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            try:
                process.send_signal(_STOP_SIGNAL)
            except OSError:
                pass


def _main_thread_running() -> bool:
    """False once the main thread finished the script (its error printed): the process is exiting."""
    return threading.main_thread().is_alive()


class _ChildObserver:
    """Rank 0's watch over its children: one thread per child waits for it to end; the first loss is
    named, the grace runs, then whatever is left stops (module docstring)."""

    def __init__(self, processes: list[subprocess.Popen], first_rank: int, link: _Link) -> None:
        self.processes = list(processes)
        self.link = link
        self._lock = threading.Lock()
        self._deadline: Optional[float] = None  # set at the first loss
        self._quiet = False  # the launcher is stopping the children itself
        for local_rank, process in enumerate(self.processes, start=1):
            threading.Thread(
                target=self._wait_for, args=(process, first_rank + local_rank), daemon=True,
                name=f"lightning_ddpx-child-{local_rank}",
            ).start()  # fmt: skip
        atexit.register(self._at_exit)

    def stop_quietly(self) -> None:
        self._quiet = True

    def _wait_for(self, process: subprocess.Popen, rank: int) -> None:
        status = process.wait()
        if status == 0 or self._quiet:
            return
        how = describe_end(status)
        note_lost(rank, f"{how} (process {process.pid})")
        with self._lock:
            first = self._deadline is None
            if first:
                self._deadline = time.monotonic() + LOSS_GRACE_S
        hint = " (its own output above says why)" if status > 0 else ""
        grace = (
            f" The other processes get {LOSS_GRACE_S:.0f} s to report their own errors; then every process of "
            "this run still running is stopped with SIGKILL, as Lightning's launcher does."
            if first
            else ""
        )
        _say(f"rank {rank} (process {process.pid}) {how}{hint}.{grace}")
        if first:
            self._end_after_grace()

    def _end_after_grace(self) -> None:
        assert self._deadline is not None
        while time.monotonic() < self._deadline:
            if not _main_thread_running():
                return  # exiting with its own error; _at_exit stops the children left at the deadline
            time.sleep(_POLL_S)
        self.link.goodbye()  # the children are stopped with this process: none should report it lost
        _stop_now(self.processes)
        os.kill(os.getpid(), _STOP_SIGNAL)

    def _at_exit(self) -> None:
        """This process exits through Python: say goodbye to the children; after a loss, stop those still
        running at the deadline."""
        self.link.goodbye()
        deadline = self._deadline
        if deadline is None:
            return  # no loss: the children end on their own, as with Lightning's launcher
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            time.sleep(_POLL_S)
        _stop_now(self.processes)


class _Link:
    """Rank 0's end of the links to its children: an abstract Unix socket (Linux; elsewhere no link, and
    a lost rank 0 is reported by the children's own errors only)."""

    def __init__(self, server: Optional[socket.socket], name: str, expected: int) -> None:
        self._server = server
        self.address = f"{os.getpid()}:{name}" if server is not None else ""
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self._said = False
        if server is not None:
            threading.Thread(
                target=self._accept, args=(expected,), daemon=True, name="lightning_ddpx-link"
            ).start()

    @classmethod
    def open(cls, expected: int) -> _Link:
        name = f"lightning_ddpx-launch-{os.getpid()}-{secrets.token_hex(8)}"
        if not sys.platform.startswith("linux") or expected == 0:
            return cls(None, name, 0)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind("\0" + name)
            server.listen(expected)
        except OSError:
            server.close()
            return cls(None, name, 0)
        return cls(server, name, expected)

    def _accept(self, expected: int) -> None:
        assert self._server is not None
        try:
            for _ in range(expected):
                connection, _ = self._server.accept()
                with self._lock:
                    if self._said:
                        connection.close()
                        continue
                    self._connections.append(connection)
        except OSError:
            pass
        finally:
            self._server.close()

    def goodbye(self) -> None:
        """Tell every child that this process ends through Python, not killed (once)."""
        with self._lock:
            if self._said:
                return
            self._said = True
            connections, self._connections = self._connections, []
        for connection in connections:
            try:
                connection.settimeout(0.5)
                connection.sendall(_GOODBYE)
            except OSError:
                pass
            finally:
                connection.close()


class _ParentWatch:
    """A child's watch over rank 0, through the link rank 0 gave it (module docstring)."""

    _started = False  # once per process: a second fit in the same child does not watch twice

    @classmethod
    def start_if_linked(cls, parent_rank: int, rank: int) -> None:
        pid_text, _, name = os.environ.get(LINK_ENV, "").partition(":")
        if cls._started or not name or not pid_text.isdigit() or int(pid_text) != os.getppid():
            return  # not started by our launcher (torchrun, a scheduler, a grandchild of the run)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect("\0" + name)
        except OSError:
            connection.close()
            return
        cls._started = True
        parent = int(pid_text)
        watch = cls(connection, parent, _pid_handle(parent), parent_rank, rank)
        threading.Thread(target=watch._run, daemon=True, name="lightning_ddpx-parent").start()

    def __init__(
        self, connection: socket.socket, parent: int, handle: Optional[int], parent_rank: int, rank: int
    ) -> None:
        self.connection, self.parent, self.handle = connection, parent, handle
        self.parent_rank, self.rank = parent_rank, rank

    def _run(self) -> None:
        try:
            said = self.connection.recv(len(_GOODBYE))
        except OSError:
            said = b""
        self.connection.close()
        if said == _GOODBYE:
            return  # rank 0 exits through Python (and printed its own error, if any)
        ended = _ended_status(self.parent, self.handle)
        if ended is False:
            return  # rank 0 is alive and closed the link itself: nothing to report
        how = _WITHOUT_PYTHON_EXIT if ended is None else describe_end(_return_code(ended))
        note_lost(self.parent_rank, f"{how} (process {self.parent})")
        _say(
            f"rank {self.parent_rank} (process {self.parent}, which started this one) {how}. This process "
            f"(rank {self.rank}) reports its own error and stops within {LOSS_GRACE_S:.0f} s."
        )
        deadline = time.monotonic() + LOSS_GRACE_S
        while time.monotonic() < deadline and _main_thread_running():
            time.sleep(_POLL_S)
        if _main_thread_running():
            os.kill(os.getpid(), _STOP_SIGNAL)


def _pid_handle(pid: int) -> Optional[int]:
    """A pidfd for ``pid`` (Linux 5.3+): readable once the process has ended, whoever collects it."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _ended_status(pid: int, handle: Optional[int], wait_s: float = 1.0) -> "int | None | bool":
    """The wait status of ``pid`` -- not our child, so read from ``/proc`` while it is a zombie, before its
    parent collects it -- ``None`` if it has ended but its status is gone, ``False`` if it is still running
    after ``wait_s`` (the link closes a moment before the process has ended)."""
    deadline = time.monotonic() + wait_s
    if handle is not None:
        ready, _, _ = select.select([handle], [], [], wait_s)
        os.close(handle)
        if not ready:
            return False
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                # the fields after the command name, which may hold spaces and parentheses
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            return None  # collected: gone from /proc
        if fields and fields[0] == "Z":
            return int(fields[49]) if len(fields) > 49 else None  # field 52, exit_code (Linux 3.5+)
        if handle is not None:
            return None  # ended (the pidfd says so), collected, and the pid already reused
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _return_code(status: int) -> int:
    """A wait status as ``subprocess`` writes it: the exit code, or minus the signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
