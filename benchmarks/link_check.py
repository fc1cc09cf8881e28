"""Check that a shaped :class:`lightning_ddpx.bench.netns.VethLink` delivers the bandwidth it promises.

    python benchmarks/link_check.py                          # 1gbit, 10gbit and unlimited, 50 MB fp32
    python benchmarks/link_check.py --rates 1gbit --mb 20 --iters 3

For each rate, two processes (one per namespace) run a gloo allreduce of ``--mb`` MB of float32 over the
veth link and report the traffic each rank sent per second. For 2 ranks a ring allreduce sends
``2 * (n - 1) / n = 1`` times the buffer each way, so that figure is directly comparable with the nominal rate;
``ratio`` is achieved / nominal. Expect a little under 1 (TCP/IP headers are ~3 % of a 1500-byte frame,
plus gloo's reduction time between the two halves of the ring); far under 1 means the tbf burst or queue is
too small, over 1 that shaping is not applied. ``unlimited`` shows what the CPU alone allows. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 29517  # each link has its own namespaces, so a fixed port never collides


def worker(node: int, mb: float, iters: int) -> None:
    """One rank: allreduce ``mb`` MB ``iters`` times after a warm-up; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{PORT}",
        rank=node,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    buffer = torch.ones(int(mb * 1e6 / 4), dtype=torch.float32)
    dist.all_reduce(buffer)  # warm-up: connections, TCP windows
    seconds = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        seconds.append(time.perf_counter() - start)
    if node == 0:
        print(json.dumps({"bytes": buffer.numel() * 4, "seconds": seconds}), flush=True)
    dist.destroy_process_group()


def measure(rate: str | None, mb: float, iters: int) -> dict:
    """Throughput of a 2-rank allreduce over a fresh VethLink at ``rate``."""
    from lightning_ddpx.bench.netns import VethLink

    with VethLink(rate=rate, prefix="ddpxlink") as link:
        procs = []
        for node in (0, 1):
            env = {**os.environ, **link.env(node), "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
            env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # no reverse-DNS warnings for the veth addresses
            argv = [sys.executable, __file__, "--worker", str(node), "--mb", str(mb), "--iters", str(iters)]
            procs.append(
                subprocess.Popen(link.command(node, argv), env=env, stdout=subprocess.PIPE, text=True)
            )
        try:
            out = procs[0].communicate(timeout=600)[0]
            procs[1].wait(timeout=60)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    if procs[0].returncode != 0 or procs[1].returncode != 0:
        raise RuntimeError(
            f"link_check worker failed at rate={rate} (exit codes {[p.returncode for p in procs]})"
        )
    result = json.loads(out.strip().splitlines()[-1])
    best = min(result["seconds"])
    median = sorted(result["seconds"])[len(result["seconds"]) // 2]
    wire_bytes = result["bytes"] * 2 * (2 - 1) / 2  # sent by each rank in a 2-rank ring allreduce
    return {
        "rate": rate or "unlimited",
        "MB": result["bytes"] / 1e6,
        "median_s": median,
        "MB/s": wire_bytes / median / 1e6,
        "best MB/s": wire_bytes / best / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit", "unlimited"])
    parser.add_argument("--mb", type=float, default=50.0, help="allreduce size in MB (float32)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.mb, args.iters)
        return
    sys.path.insert(0, REPO_ROOT)
    from lightning_ddpx.bench.netns import netns_unavailable_reason, parse_rate

    reason = netns_unavailable_reason()
    if reason is not None:
        sys.exit(f"link_check: skipped: {reason}")
    print(
        f"{'rate':>10} {'MB':>6} {'median s':>9} {'MB/s':>8} {'best MB/s':>10} {'nominal MB/s':>13} {'ratio':>6}"
    )
    for rate in args.rates:
        row = measure(None if rate == "unlimited" else rate, args.mb, args.iters)
        nominal = parse_rate(rate) / 8e6 if rate != "unlimited" else float("nan")
        print(
            f"{row['rate']:>10} {row['MB']:>6.1f} {row['median_s']:>9.3f} {row['MB/s']:>8.1f} "
            f"{row['best MB/s']:>10.1f} {nominal:>13.1f} {row['MB/s'] / nominal:>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
