"""Copy the package as it was at a git revision, importable under another name, to time it beside today's.

    python benchmarks/snapshot_package.py 1900a2e /tmp/before     # -> /tmp/before/lightning_ddpx_before
    python benchmarks/bench_engine.py --before /tmp/before ...     # torch, the snapshot and ours, interleaved

A change's speed is best shown by the code before and after it timed in the same run, on the same machine
state: the snapshot is the package at ``REV`` with every ``lightning_ddpx`` import renamed to
``lightning_ddpx_before``, so both versions load in one process. It goes outside the repository (it is
scratch, never committed).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import subprocess
import sys
import tarfile

SNAPSHOT_NAME = "lightning_ddpx_before"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(rev: str, dest: str) -> str:
    """Write the package at ``rev`` to ``dest/lightning_ddpx_before``; returns that directory."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "lightning_ddpx"],
        cwd=_REPO_ROOT,
        check=True,
        capture_output=True,
    ).stdout
    target = os.path.join(dest, SNAPSHOT_NAME)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            relative = member.name.split("/", 1)[1]
            path = os.path.join(target, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if path.endswith(".py"):
                data = re.sub(rb"\blightning_ddpx\b", SNAPSHOT_NAME.encode(), data)
            with open(path, "wb") as out:
                out.write(data)
    return target


def snapshot_module_class(dest: str) -> type:
    """The ``DistributedDataParallel`` of the snapshot written to ``dest`` by :func:`snapshot`, importable
    beside today's package (a benchmark's "before" contender)."""
    if dest not in sys.path:
        sys.path.insert(0, dest)
    return importlib.import_module(SNAPSHOT_NAME).DistributedDataParallel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rev", help="a git revision of this repository, e.g. a commit before a change")
    parser.add_argument(
        "dest", help="a directory outside the repository; the snapshot goes in a subdirectory"
    )
    args = parser.parse_args(argv)
    print(snapshot(args.rev, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
