"""Run torch's own DDP tests, as shipped in the torch wheel, against ``lightning_ddpx.DistributedDataParallel``.

torch tests its DDP in ``torch.testing._internal.distributed.distributed_test`` (class
``DistributedTest._DistTestBase``), which its CI runs through ``test/distributed/test_distributed_spawn.py``
with ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` in the environment: each case starts ``WORLD_SIZE``
processes, initialises the group from a file and runs the case on every rank. This driver does the same for
the CPU/gloo DDP cases, 2 ranks, and with ``--impl ours`` puts our class in place of torch's inside each
rank process, under the two names the cases reach it by (``torch.nn.parallel.DistributedDataParallel`` and
the module's own ``DistributedDataParallel`` import). torch's code is driven, not copied.

Usage (from the repository root)::

    python -m tests.peer.torch_ddp_driver --impl ours            # the driven cases (tests/peer/cases.py)
    python -m tests.peer.torch_ddp_driver --impl torch --all     # every candidate, torch's class
    python -m tests.peer.torch_ddp_driver --impl ours -k no_sync --json results.json
    python -m tests.peer.torch_ddp_driver --impl none --every     # rediscover: which cases build a DDP

Ranks are forked from this process (torch's launcher spawns them, re-importing torch each time: slower,
same result; ``--spawn`` uses it). The exit status is 0 when every selected case passed or was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unittest
from typing import Any

# distributed_test reads these when it is imported; 2 ranks on gloo is what this driver checks.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.parallel  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

from tests.peer.cases import CANDIDATES, EXCLUDED, every_case  # noqa: E402

IMPL_VARIABLE = "DDPX_PEER_IMPL"  # read in each rank process: "ours" or "torch"
SPAWN_VARIABLE = "DDPX_PEER_SPAWN"


class _Sentinel:
    """Stands in for DDP under ``--impl none``: a case that fails with it constructs DDP (discovery)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("peer-driver sentinel: this case constructs DistributedDataParallel")


def substitute(impl: str) -> None:
    """Make the names torch's cases construct DDP by refer to ``impl``'s class (in this process only)."""
    if impl == "torch":
        return
    if impl == "ours":
        from lightning_ddpx import DistributedDataParallel as replacement
    else:
        replacement = _Sentinel
    torch.nn.parallel.DistributedDataParallel = replacement  # type: ignore[misc]
    distributed_test.DistributedDataParallel = replacement  # type: ignore[attr-defined]


class PeerDDPTest(TestDistBackend, DistributedTest._DistTestBase):
    """torch's ``TestDistBackendWithSpawn``, with our class substituted in the rank processes on request."""

    def setUp(self) -> None:
        super().setUp()
        if os.environ.get(SPAWN_VARIABLE) == "1":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
        substitute(os.environ.get(IMPL_VARIABLE, "torch"))
        super()._run(rank, test_name, file_name, pipe, **kwargs)


class _Recorder(unittest.TextTestResult):
    """Each case's outcome, duration and (for failures) the last lines of the rank's error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test: unittest.TestCase, status: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        seconds = round(time.monotonic() - self._started, 1)
        self.outcomes[name] = {"status": status, "seconds": seconds, "detail": _last_error(detail)}

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._record(test, "failed", self.failures[-1][1])

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._record(test, "failed", self.errors[-1][1])

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)


def _last_error(text: str) -> str:
    """The rank's exception line(s): what a reader needs to see why the case failed."""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line.strip() for line in lines if "Error" in line or "assert" in line.lower()]
    return " | ".join(errors[-3:])[-600:] if errors else "\n".join(lines[-3:])[-600:]


def run_cases(
    names: list[str], impl: str, spawn: bool = False, verbosity: int = 1
) -> dict[str, dict[str, Any]]:
    """Run ``names`` (methods of ``_DistTestBase``) with ``impl``'s class; ``{name: outcome}``."""
    os.environ[IMPL_VARIABLE] = impl
    os.environ[SPAWN_VARIABLE] = "1" if spawn else "0"
    suite = unittest.TestSuite(PeerDDPTest(name) for name in names)
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=verbosity, stream=sys.stderr)
    result = runner.run(suite)
    return result.outcomes  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--impl", choices=("ours", "torch", "none"), default="ours")
    parser.add_argument("--all", action="store_true", help="also run the excluded cases")
    parser.add_argument("--every", action="store_true", help="every test_* case of _DistTestBase (discovery)")
    parser.add_argument("-k", dest="pattern", default="", help="only cases whose name contains this")
    parser.add_argument("--spawn", action="store_true", help="spawn ranks as torch's launcher does")
    parser.add_argument("--json", dest="json_path", help="write {case: outcome} here")
    args = parser.parse_args(argv)
    names = [
        name
        for name in (every_case(DistributedTest._DistTestBase) if args.every else CANDIDATES)
        if args.pattern in name and (args.all or name not in EXCLUDED)
    ]
    started = time.monotonic()
    outcomes = run_cases(names, args.impl, spawn=args.spawn)
    counts = {
        status: sum(o["status"] == status for o in outcomes.values())
        for status in ("passed", "failed", "skipped")
    }
    print(
        f"{args.impl}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped of "
        f"{len(names)} cases in {time.monotonic() - started:.0f} s"
    )
    for name, outcome in sorted(outcomes.items()):
        print(
            f"  {outcome['status']:8} {outcome['seconds']:6.1f} s  {name}  {outcome['detail'] if outcome['status'] == 'failed' else ''}"
        )
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump(outcomes, file, indent=1, sort_keys=True)
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
