"""How the strategies start a fault-tolerant run: the process the user started supervises, and trains nothing.

Lightning's own launchers make the launching process rank 0 (``popen``) or kill every process when one dies
(``spawn``: "to avoid zombies"). With ``fault_tolerance`` on, :class:`FaultTolerantLauncher` (Trainer) and
:class:`FabricFaultTolerantLauncher` (Fabric) instead run the script's training processes under the fault
tolerance supervisor (:class:`~lightning_ddpx.fault.launch.Supervisor`): it hosts the run's store, outlives
every training process, and starts up to ``replacements`` replacements. A training process is recognised by
the variables the supervisor gives it (:mod:`lightning_ddpx.fault.launch_env`); the same script, started by
``python -m lightning_ddpx.fault.launch`` on each machine, runs across machines the same way.

- **Trainer.** ``trainer.fit`` in the launching process returns once the training processes are done, with
  the trained weights loaded into the LightningModule, and ``trainer.state``, ``global_step``,
  ``current_epoch``, ``callback_metrics`` and the checkpoint callback's ``best_model_path`` as the last rank 0
  left them (written to a results file by whichever process was rank 0 at the end: :func:`write_results`).
  The training processes end with ``fit``: what the script does after it runs once, in the launching process.
  Later ``validate``/``test``/``predict`` calls there run in that one process, on the trained weights.
- **Fabric.** ``fabric.launch()`` in the launching process supervises and then exits with the training
  processes' exit code: the script's training loop runs in the training processes only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import tempfile
import traceback
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from lightning_ddpx.engine.agreement.errors import is_communication_failure
from lightning_ddpx.fault.launch import Supervisor
from lightning_ddpx.fault.launch_env import ENV_UID
from lightning_ddpx.fault.manager import FaultTolerance
from lightning_ddpx.fault.membership import FaultToleranceError, RunEnded
from lightning_ddpx.fault.options import FaultToleranceOptions
from lightning_ddpx.lightning import _compat as lightning_compat

__all__ = [
    "ENV_ERRORS",
    "ENV_RESULTS",
    "FabricFaultTolerantLauncher",
    "FaultTolerantEnvironment",
    "FaultTolerantLauncher",
    "contain_logger_failures",
    "continue_loggers",
    "in_training_process",
    "join_run",
    "report_error",
    "write_results",
]

log = logging.getLogger(__name__)

ENV_RESULTS = "DDPX_FT_RESULTS"  # where the last rank 0 writes what fit() returns to the launching process
ENV_ERRORS = "DDPX_FT_ERRORS"  # where a training process reports an error of the training code's own


def in_training_process() -> bool:
    """Whether this process was started by the fault-tolerance supervisor (the strategies' launcher or the
    command-line one), rather than by the user."""
    return bool(os.environ.get(ENV_UID))


class FaultTolerantEnvironment(ClusterEnvironment):
    """Ranks as the run's current membership has them: a process's rank and the world size change when a
    member is lost or a newcomer admitted (:attr:`fault`, set once the process joined the run). The launching
    process, and a process before it joined, is a world of one."""

    def __init__(self, num_processes: int = 1) -> None:
        self.num_processes = num_processes
        self.fault: Optional[FaultTolerance] = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return in_training_process()  # the supervisor started this one: Lightning starts no other

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("DDPX_FT_STORE_HOST", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return int(os.environ.get("DDPX_FT_STORE_PORT", "0"))

    @staticmethod
    @override
    def detect() -> bool:
        return in_training_process()

    @override
    def world_size(self) -> int:
        return self.fault.world_size if self.fault is not None else 1

    @override
    def set_world_size(self, size: int) -> None:
        """Ignored: the membership decides."""

    @override
    def global_rank(self) -> int:
        return self.fault.rank if self.fault is not None else 0

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ignored: the membership decides."""

    @override
    def local_rank(self) -> int:
        """Which of this machine's devices: the process's place among those the supervisor started (its uid's
        number), modulo the devices (a replacement takes a lost process's place)."""
        uid = os.environ.get(ENV_UID, "0")
        return int(uid.rsplit("-", 1)[-1]) % max(self.num_processes, 1)

    @override
    def node_rank(self) -> int:
        return 0


def join_run(options: FaultToleranceOptions) -> FaultTolerance:
    """This training process's part in the run, once admitted. A replacement that arrives after the last
    step has nothing to do: it says so and exits with code 0."""
    try:
        return FaultTolerance(options, backend="gloo")
    except RunEnded as ended:
        log.warning(str(ended))
        _end_training_process()
        raise  # not reached


def supervise(
    num_processes: int,
    options: FaultToleranceOptions,
    env: dict[str, str],
    not_replaced: Optional[Callable[[str], Optional[str]]] = None,
) -> int:
    """Run this script's ``num_processes`` training processes under the supervisor; their exit code."""
    supervisor = Supervisor(
        list(lightning_compat.script_command()),
        num_processes,
        replacements=options.replacements,
        env=env,
        not_replaced=not_replaced,
    )
    return supervisor.run()


class FaultTolerantLauncher(lightning_compat.TrainerLauncher):
    """The Trainer's launcher with ``fault_tolerance`` (see the module's docstring)."""

    def __init__(
        self,
        num_processes: int,
        options: FaultToleranceOptions,
        check: Optional[Callable[[Any], None]] = None,
    ) -> None:
        """``check(trainer)`` refuses, in the launching process, what the training processes would refuse
        (manual optimisation, a backend other than gloo) before any of them starts."""
        self.num_processes, self.options, self._check = num_processes, options, check
        self.trainer: Any = None  # the training process's Trainer, for the strategy's heal
        self._supervised = False

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False  # the training processes run the script again

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        fitting = trainer is not None and lightning_compat.is_fitting(trainer)
        if in_training_process():
            if not fitting:
                raise FaultToleranceError(
                    "lightning_ddpx fault tolerance: the training processes run trainer.fit() only; call "
                    "validate(), test() or predict() after fit() -- they then run in the process you started, "
                    "on the trained weights."
                )
            self.trainer = trainer
            try:
                results = function(*args, **kwargs)
            except Exception as error:
                report_error(error)  # the launching process raises it; a replacement would raise it again
                raise
            if os.environ.get(ENV_RESULTS) and trainer.is_global_zero:
                write_results(trainer, results, os.environ[ENV_RESULTS])
            _end_training_process()
        if not fitting:
            return function(*args, **kwargs)  # after fit, in the launching process: a world of one
        if self._supervised:
            raise FaultToleranceError(
                "lightning_ddpx fault tolerance: one trainer.fit() per script (the training processes run the "
                "script again, up to its first fit); build a new script for another run."
            )
        self._supervised = True
        if self._check is not None:
            self._check(trainer)
        with tempfile.TemporaryDirectory(prefix="ddpx-ft-") as directory:
            path, errors = os.path.join(directory, "results.pt"), os.path.join(directory, "errors")
            os.makedirs(errors)
            env = {ENV_RESULTS: path, ENV_ERRORS: errors}
            code = supervise(
                self.num_processes, self.options, env, lambda uid: _why_not_replaced(errors, uid)
            )
            if not os.path.exists(path):
                _raise_what_ended_the_run(code, errors)
            return _recover_results(trainer, path)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill here: the supervisor stops its children when the launching process is stopped."""


class FabricFaultTolerantLauncher(lightning_compat.FabricLauncher):
    """Fabric's launcher with ``fault_tolerance``: the launching process supervises the training processes,
    then exits with their exit code (see the module's docstring)."""

    def __init__(self, num_processes: int, options: FaultToleranceOptions) -> None:
        self.num_processes, self.options = num_processes, options

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        if in_training_process():
            return function(*args, **kwargs)
        code = supervise(self.num_processes, self.options, {})
        sys.exit(code)


def report_error(error: BaseException) -> None:
    """In a training process: write ``error`` (an error of the training code's own: not a lost peer) where
    the launching process looks (``DDPX_FT_ERRORS``), so that it is not retried by a replacement and the
    user's ``fit`` raises it. A communication failure is a loss, replaced as usual: not reported."""
    directory, uid = os.environ.get(ENV_ERRORS), os.environ.get(ENV_UID)
    if not directory or not uid or is_communication_failure(error):
        return
    try:
        pickled: Optional[bytes] = pickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception that does not pickle is raised by its text
        pickled = None
    report = {
        "uid": uid,
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
        "pickled": pickled,
    }
    target = os.path.join(directory, f"{uid}.error")
    with contextlib.suppress(OSError):
        with open(f"{target}.partial", "wb") as file:
            pickle.dump(report, file)
        os.replace(f"{target}.partial", target)


def _reports(directory: str) -> list[dict[str, Any]]:
    found = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".error"):
            with contextlib.suppress(Exception), open(os.path.join(directory, name), "rb") as file:
                found.append(pickle.load(file))  # written by this run's own training processes
    return found


def _why_not_replaced(directory: str, uid: str) -> Optional[str]:
    """A lost training process that reported an error of the training code's own is not replaced: the
    replacement would run the same code on the same state and raise it again."""
    for report in _reports(directory):
        if report["uid"] == uid:
            return (
                f"process {uid} raised {report['type'].rsplit('.', 1)[-1]}: {report['message'][:200]}; not "
                "replaced (a replacement would raise it again)"
            )
    return None


def _raise_what_ended_the_run(code: int, directory: str) -> None:
    """In the launching process, once the training processes ended without a result: raise what ended them
    -- a Ctrl-C (KeyboardInterrupt, which Lightning reports as an interrupted fit), a SIGTERM, the first
    error a training process reported (the exception itself, with that process named), or the losses."""
    if code == 128 + signal.SIGINT:  # the supervisor's code for a stop by that signal
        log.warning(
            "lightning_ddpx fault tolerance: interrupted (Ctrl-C): the training processes were stopped."
        )
        raise KeyboardInterrupt
    if code == 128 + signal.SIGTERM:
        raise FaultToleranceError(
            "lightning_ddpx fault tolerance: stopped by SIGTERM: the training processes were stopped."
        )
    reports = _reports(directory)
    if reports:
        first = reports[0]
        note = f"raised in training process {first['uid']} of the fault-tolerant run; its traceback:\n"
        try:
            error = pickle.loads(first["pickled"]) if first["pickled"] is not None else None
        except Exception:  # noqa: BLE001 - raised by its text below
            error = None
        if isinstance(error, BaseException):
            if hasattr(error, "add_note"):
                error.add_note(note + first["traceback"])
            raise error
        raise FaultToleranceError(f"{first['type']}: {first['message']}\n({note}{first['traceback']})")
    ended = f" (exit code {code})" if code else ""  # 0: only a replacement that found no run left
    raise FaultToleranceError(
        f"lightning_ddpx fault tolerance: the training processes ended{ended} and none returned the trained "
        "model: every process was lost, or more were lost than replacements and min_ranks allow. Their logs "
        "say why."
    )


def write_results(trainer: Any, results: Any, path: str) -> None:
    """What the launching process's ``fit`` returns with, written atomically by the last rank 0; also the
    loggers' versions, so that what the launching process logs afterwards (``trainer.test``) joins them."""
    callback = trainer.checkpoint_callback
    payload = {
        "weights": {k: v.detach().cpu() for k, v in trainer.lightning_module.state_dict().items()},
        "trainer_state": trainer.state,
        "fit_loop": trainer.fit_loop.state_dict(),
        "callback_metrics": {k: v.detach().cpu() for k, v in trainer.callback_metrics.items()},
        "best_model_path": getattr(callback, "best_model_path", None),
        "logger_versions": [logger.version for logger in lightning_compat.versioned_loggers(trainer)],
        "results": results,
    }
    partial = f"{path}.partial-{os.getpid()}"
    torch.save(payload, partial)
    os.replace(partial, path)


def _recover_results(trainer: Any, path: str) -> Any:
    payload = torch.load(path, weights_only=False)  # written by this run's own training process
    trainer.lightning_module.load_state_dict(payload["weights"])
    trainer.state = payload["trainer_state"]
    trainer.fit_loop.load_state_dict(payload["fit_loop"])
    trainer.fit_loop.restarting = False  # the loaded counters describe a finished fit, not one to resume
    trainer.callback_metrics.update(payload["callback_metrics"])
    callback = trainer.checkpoint_callback
    if (
        callback is not None
        and payload["best_model_path"] is not None
        and hasattr(callback, "best_model_path")
    ):
        callback.best_model_path = payload["best_model_path"]
    continue_loggers(trainer, payload["logger_versions"])  # what it logs after fit joins the run's logs
    return payload["results"]


def continue_loggers(trainer: Any, versions: list[Any]) -> None:
    """Every process of a run logs into the same versions, and a process that becomes rank 0 later (or the
    launching process after fit) appends to the metrics written before: Lightning's CSV writer deletes an
    existing ``metrics.csv`` when it starts, so it gets one that continues the file instead."""
    for logger, version in zip(lightning_compat.versioned_loggers(trainer), versions):
        lightning_compat.pin_logger(logger, version)
        if isinstance(logger, CSVLogger):
            lightning_compat.pin_logger(logger, version, lightning_compat.ContinuingCSVWriter(logger.log_dir))


_LOGGER_CALLS = ("log_metrics", "log_hyperparams", "log_graph", "save", "finalize", "after_save_checkpoint")


def contain_logger_failures(trainer: Any) -> None:
    """A logger that raises in a fault-tolerant run's training process (a full disk, a file another rank 0
    left behind, a tracking server away) costs its own records, never the run: each failing call is
    reported once per logger and call, at WARNING, with the error, and training goes on."""
    for logger in trainer.loggers:
        for name in _LOGGER_CALLS:
            call = getattr(logger, name, None)
            if callable(call) and not getattr(call, "ddpx_contained", False):
                setattr(logger, name, _contained(logger, name, call))


def _contained(logger: Any, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    reported = False

    def contained(*args: Any, **kwargs: Any) -> Any:
        nonlocal reported
        try:
            return call(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a logger's failure must not end the run
            if not reported:
                reported = True
                log.warning(
                    "lightning_ddpx fault tolerance: %s.%s failed (%s: %s); training goes on without these "
                    "records (reported once).",
                    type(logger).__name__,
                    name,
                    type(error).__name__,
                    error,
                )
            return None

    contained.ddpx_contained = True  # type: ignore[attr-defined]
    return contained


def _end_training_process() -> None:
    """A training process ends with ``fit``: the rest of the script runs in the launching process. Its
    strategy already tore down (the process group is destroyed, the membership left); exit at once rather
    than through the interpreter's finalisation, where a communication thread could still hold a tensor."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    lightning_compat.exit_now(0)
