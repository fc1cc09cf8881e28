"""What the parameter-averaging guard costs: per optimizer step and per synchronising forward.

    python benchmarks/bench_averaging_guard.py

One process, a one-rank gloo group. A module whose hook brings parameter averaging (here DiLoCo) installs
one global optimizer step post-hook, which looks the stepping optimizer up in a cache, and compares two
integers at each synchronising forward (:mod:`lightning_ddpx.engine.optim.parameter_averaging`). Printed:
the hook's time per ``optimizer.step()`` (an optimizer holding the module's parameters, and another one),
the check's time per forward, both from ``timeit`` (best of 5), against an SGD step of the same model and
the module's whole forward bookkeeping (``_before_forward``); and that a module without parameter averaging
installs no hook at all.
"""

from __future__ import annotations

import os
import sys
import timeit

if __package__ in (None, ""):  # run as a script: make `lightning_ddpx` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim.optimizer import _global_optimizer_post_hooks  # noqa: E402

CALLS = 100_000


def per_call_us(fn, calls: int = CALLS) -> float:
    return min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6


def model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])


def measure(layers: int) -> str:
    """One row: a DiLoCo-registered model of ``2 * layers`` parameters."""
    from lightning_ddpx import DistributedDataParallel
    from lightning_ddpx.hooks import build_comm_hook

    ddp = DistributedDataParallel(model(layers))
    ddp.register_comm_hook(*build_comm_hook("diloco", diloco={"period": 100}))
    hook = list(_global_optimizer_post_hooks.values())[-1]
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.0, momentum=0.9)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.0)
    for p in ddp.parameters():
        p.grad = torch.zeros_like(p)
    step = per_call_us(optimizer.step, 500)  # hook included
    ddp.average_parameters_after_step()  # the check below sees no step to complain about
    ours = per_call_us(lambda: hook(optimizer, (), {}))
    another = per_call_us(lambda: hook(other, (), {}))
    bound = ddp._averaging
    bound._steps_since_check = 0
    check = per_call_us(lambda: bound.check_before_sync(0))
    before_forward = per_call_us(ddp._before_forward, 2000)
    ddp.close()
    return (
        f"{2 * layers:10d} | {step:11.1f} | {ours:.2f} / {another:.2f} | {check:.2f} | {before_forward:.1f}"
    )


def main() -> None:
    from lightning_ddpx import DistributedDataParallel
    from lightning_ddpx.hooks import build_comm_hook

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    hooks_before = len(_global_optimizer_post_hooks)
    plain = DistributedDataParallel(model(4))
    plain.register_comm_hook(*build_comm_hook("allreduce"))
    print(
        f"no parameter averaging: {len(_global_optimizer_post_hooks) - hooks_before} optimizer hooks installed"
    )
    print(
        "parameters | SGD step us (with the hook) | guard per step us (ours / another optimizer) | check per forward us | _before_forward us"
    )
    for layers in (4, 150):
        print(measure(layers))
    plain.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
