"""Alternatives to the engine's transports, injected by benchmarks to measure what a special case would gain.

The production classes carry no switch "only to measure": a benchmark builds the module as users do, then
hands its reducer one of these (``model.reducer.use_transport(...)``, on every rank alike, before the first
step) and times both side by side.

- :class:`MeanAllReduceInHalves`: the default path with every bucket of 4 MiB or more reduced as two
  all-reduces of its halves, issued together (gloo runs them on its two worker threads). Bit-identical to one
  all-reduce for two ranks (each element is ``a + b`` either way); not for three or more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ddpx.engine.buckets.grad_bucket import GradBucket, payload_bytes, record_bytes_sent
from lightning_ddpx.engine.transport.transports import MeanAllReduce

__all__ = ["MeanAllReduceInHalves", "HALVES_MIN_BYTES"]

HALVES_MIN_BYTES = 4 * 1024 * 1024


class MeanAllReduceInHalves(MeanAllReduce):
    """:class:`~lightning_ddpx.engine.transport.transports.MeanAllReduce`, large dense buckets in two halves."""

    def describe(self) -> str:
        return f"the mean all-reduce, buckets from {HALVES_MIN_BYTES} bytes in halves (benchmark alternative)"

    def reduce(self, grad_bucket: GradBucket, prefilled: bool) -> torch.futures.Future:
        buffer = grad_bucket.buffer()
        if buffer.is_sparse or payload_bytes(buffer) < HALVES_MIN_BYTES:
            return super().reduce(grad_bucket, prefilled)
        record_bytes_sent(grad_bucket, payload_bytes(buffer))
        futures = [
            dist.all_reduce(half, group=self.state, async_op=True).get_future()
            for half in buffer.tensor_split(2)
        ]
        return torch.futures.collect_all(futures).then(lambda _: buffer)
