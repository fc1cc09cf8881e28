"""Check that a shaped :class:`lightning_ddpx.bench.netns.VethLink` delivers the bandwidth it promises.

    python benchmarks/link_check.py                          # 1gbit, 10gbit and unlimited, 50 MB fp32
    python benchmarks/link_check.py --rates 1gbit --mb 20 --iters 3

For each rate, two processes (one per namespace, started by ``lightning_ddpx.bench.launch.run_ranks`` as
for ``python -m lightning_ddpx.bench --link``) run a gloo allreduce of ``--mb`` MB of float32 over the
veth link and report the traffic each rank sent per second. For 2 ranks a ring allreduce sends
``2 * (n - 1) / n = 1`` times the buffer each way, so that figure is directly comparable with the nominal rate;
``ratio`` is achieved / nominal. Expect a little under 1 (TCP/IP headers are ~3 % of a 1500-byte frame,
plus gloo's reduction time between the two halves of the ring); far under 1 means the tbf burst or queue is
too small, over 1 that shaping is not applied. ``unlimited`` shows what the CPU alone allows. Needs root.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script: make `lightning_ddpx` importable
    sys.path.insert(0, REPO_ROOT)

from lightning_ddpx.bench.launch import run_ranks, write_result  # noqa: E402

WORKER = (
    "benchmarks.link_check"  # run_ranks starts this module as `python -m benchmarks.link_check CONFIG RANK`
)


def worker(config_path: str, rank: int) -> None:
    """One rank: allreduce ``mb`` MB ``iters`` times after a warm-up; its seconds go back to :func:`measure`."""
    import json

    import torch
    import torch.distributed as dist

    with open(config_path) as f:
        config = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    buffer = torch.ones(int(config["mb"] * 1e6 / 4), dtype=torch.float32)
    dist.all_reduce(buffer)  # warm-up: connections, TCP windows
    seconds = []
    for _ in range(config["iters"]):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        seconds.append(time.perf_counter() - start)
    dist.destroy_process_group()
    write_result(config_path, rank, {"bytes": buffer.numel() * 4, "seconds": seconds})


def measure(rate: str, mb: float, iters: int) -> dict:
    """Throughput of a 2-rank allreduce over a fresh veth link at ``rate`` (``"unlimited"``: no shaping)."""
    result = run_ranks({"world_size": 2, "mb": mb, "iters": iters}, rate, timeout_s=600, worker=WORKER)[0]
    best = min(result["seconds"])
    median = sorted(result["seconds"])[len(result["seconds"]) // 2]
    wire_bytes = result["bytes"] * 2 * (2 - 1) / 2  # sent by each rank in a 2-rank ring allreduce
    return {
        "rate": rate,
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
    args = parser.parse_args()
    from lightning_ddpx.bench.netns import netns_unavailable_reason, parse_rate

    reason = netns_unavailable_reason()
    if reason is not None:
        sys.exit(f"link_check: skipped: {reason}")
    # The ranks import this module from the repository; no reverse-DNS warnings for the veth addresses.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    print(
        f"{'rate':>10} {'MB':>6} {'median s':>9} {'MB/s':>8} {'best MB/s':>10} {'nominal MB/s':>13} {'ratio':>6}"
    )
    for rate in args.rates:
        row = measure(rate, args.mb, args.iters)
        nominal = parse_rate(rate) / 8e6 if rate != "unlimited" else float("nan")
        print(
            f"{row['rate']:>10} {row['MB']:>6.1f} {row['median_s']:>9.3f} {row['MB/s']:>8.1f} "
            f"{row['best MB/s']:>10.1f} {nominal:>13.1f} {row['MB/s'] / nominal:>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[2].isdigit():  # a rank, started by run_ranks: CONFIG RANK
        worker(sys.argv[1], int(sys.argv[2]))
    else:
        main()
