"""Which of torch's DDP test cases the peer job drives (:mod:`tests.peer.torch_ddp_driver`), and which not, why.

``CANDIDATES`` are the cases of torch's ``DistributedTest._DistTestBase`` (torch 2.13's wheel) that construct
``DistributedDataParallel`` and run on CPU with gloo and 2 ranks. They were found by running every case with
a stand-in class that raises when constructed (``--impl none --every``): the cases that then fail build a
DDP, and of those, these are the ones torch's own class passes here (the rest are skipped on a machine
without 2 GPUs). ``EXCLUDED`` lists the candidates that check torch internals rather than behaviour a user
relies on, each with the reason; every other candidate must pass with our class.
"""

from __future__ import annotations

CANDIDATES: tuple[str, ...] = (
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_ddp_create_graph",
    "test_ddp_logging_data_cpu",
    "test_grads_same_across_ranks_with_no_sync",
    "test_static_graph_api_cpu",
)

EXCLUDED: dict[str, str] = {
    "test_ddp_logging_data_cpu": (
        "reads the runtime timings torch's C++ reducer takes at sampled iterations (forward_compute_time, "
        "backward_compute_time, backward_comm_time, their overlap and averages, in ns) and its per-iteration "
        "gradient-ready order; lightning_ddpx's _get_ddp_logging_data() gives torch's construction keys, "
        "iteration, buckets and errors (tests/engine/test_torch_api.py) but takes no such timings: comm_stats() "
        "reports what our reducer measures."
    ),
}

# Candidates that fail with our class until a fix made elsewhere lands: the peer test expects them to fail
# (strictly: once they pass, remove them from here).
PENDING: dict[str, str] = {}


def every_case(base: type) -> list[str]:
    """Every test case of ``base`` (torch's ``_DistTestBase``), for rediscovering the candidates."""
    return sorted(name for name in dir(base) if name.startswith("test_") and callable(getattr(base, name)))
