"""How a DiLoCo fragment's parameter change crosses the link: the mean over the ranks, in a chosen precision.

``precision`` picks one of two kinds of exchange:

- ``"fp32"``, ``"bf16"``, ``"fp16"`` (:class:`AllReducedMean`): the change is cast, divided by the world size
  and all-reduced (summed) in that dtype: 4 or 2 bytes per element.
- ``"int8"``, ``"int4"`` (:class:`QuantizedMean`): the change is quantized in blocks of :data:`BLOCK`
  elements -- each block's largest magnitude sets its scale, every element is rounded to the nearest of
  ``2 * qmax + 1`` levels -- so an element costs 1 byte or half a byte, plus one fp32 scale per block
  (int4: 7.5x fewer bytes than fp32). The streaming DiLoCo paper (arXiv 2501.18512) sends its outer
  gradients in 4 bits at no loss. Integer codes with their own scales cannot be summed by a collective, so
  the mean is computed the way a ring all-reduce computes a sum, in two phases, each rank owning one
  chunk: (1) an all-to-all hands rank ``r`` every rank's codes of chunk ``r``, which it decodes and
  averages in fp32, adding the ranks' values in rank order; (2) each rank quantizes its chunk of the mean
  and an all-gather hands every chunk to every rank, which decodes them all. Each rank sends its payload's
  ``(W - 1) / W`` in each phase, as a ring all-reduce of that payload does, so the bytes recorded are the
  payload's, comparable to the other hooks' all-reduce payloads at any world size. Every rank decodes the
  same gathered bytes with the same operations: the mean is the same, bit for bit, on every rank. It is
  also the same whichever device each rank computes on: every step of the codec and of the mean is exact
  or correctly rounded on the CPU and on CUDA alike (the scales ``amax / qmax`` and the mean ``sum / W``
  divide by tensors, :func:`divide`; decoding multiplies), so a CUDA run gives a CPU run's bits.

Rounding is to nearest (ties to even), with no randomness, so a resumed run repeats the same exchanges.
The functions :func:`quantize` and :func:`dequantize` are pure tensor code, tested in one process.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import waiting_for

__all__ = [
    "BLOCK",
    "FLOAT_PRECISIONS",
    "PRECISIONS",
    "QUANTIZED_BITS",
    "AllReducedMean",
    "CompletedMean",
    "OuterExchange",
    "QuantizedMean",
    "dequantize",
    "divide",
    "quantize",
    "start_exchange",
]

FLOAT_PRECISIONS: dict[str, Optional[torch.dtype]] = {
    "fp32": None,  # the parameters' own dtype
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
QUANTIZED_BITS: dict[str, int] = {"int8": 8, "int4": 4}
PRECISIONS: tuple[str, ...] = (*FLOAT_PRECISIONS, *QUANTIZED_BITS)
BLOCK = 128  # elements per scale: 4 bytes of scale per 128 codes (3 % of an int4 payload)


# ------------------------------------------------------------------------------------------- codec
def divide(values: torch.Tensor, count: int) -> torch.Tensor:
    """``values / count``, correctly rounded on every device: the same bits on the CPU and on CUDA.

    The divisor is a 0-dim tensor of ``values``' dtype on their device (``count`` is a small integer, exact in
    that dtype). A division by a Python number -- or by a CPU tensor of one element -- is computed by CUDA
    as a multiplication by the divisor's rounded reciprocal, which misses the correctly rounded quotient in
    the last bit for many values (``x / 7``: about half of them); the CPU divides, and so does CUDA when the
    divisor is a tensor on the GPU. Both follow IEEE division, so the two agree bit for bit."""
    return values / torch.full((), count, dtype=values.dtype, device=values.device)


def quantize(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """``blocks``: float32 of shape ``(rows, k * BLOCK)``. Returns uint8 of shape ``(rows, row_bytes)``: each
    row's codes (``bits`` per element, two int4 codes per byte, low nibble first) then its blocks' fp32
    scales. A block's scale is its largest magnitude over ``qmax = 2 ** (bits - 1) - 1``; an element's
    code is ``round(x / scale)`` (an all-zero block: scale 0, codes 0). Every step is exact or correctly
    rounded (both divisions are by tensors: :func:`divide`), so the CPU and CUDA give the same bytes."""
    rows = blocks.shape[0]
    qmax = 2 ** (bits - 1) - 1
    grouped = blocks.reshape(rows, -1, BLOCK)
    scales = divide(grouped.abs().amax(dim=2, keepdim=True), qmax)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(grouped / divisor).clamp_(-qmax, qmax).reshape(rows, -1)
    if bits == 8:
        packed = codes.to(torch.int8).view(torch.uint8)
    else:  # offset to 1..15, two per byte
        nibbles = (codes + 8).to(torch.uint8)
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    scale_bytes = scales.reshape(rows, -1).contiguous().view(torch.uint8)
    return torch.cat([packed, scale_bytes], dim=1)


def dequantize(payload: torch.Tensor, bits: int, row_numel: int) -> torch.Tensor:
    """The float32 values ``(rows, row_numel)`` that :func:`quantize` encoded in ``payload``."""
    rows = payload.shape[0]
    code_bytes = row_numel * bits // 8
    packed, scale_bytes = payload[:, :code_bytes], payload[:, code_bytes:]
    scales = scale_bytes.contiguous().view(torch.float32).reshape(rows, -1, 1)
    if bits == 8:
        codes = packed.contiguous().view(torch.int8).to(torch.float32)
    else:
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(rows, -1)
        codes = nibbles.to(torch.float32) - 8
    return (codes.reshape(rows, -1, BLOCK) * scales).reshape(rows, row_numel)


# --------------------------------------------------------------------------------------- exchanges
class OuterExchange:
    """One fragment's exchange, started; :meth:`result` is the mean change over the ranks (waiting for it)."""

    bytes_sent: int  # this rank's payload
    # what reaches this rank: an all-reduce's (or the quantized two phases') result, the payload's size;
    # an all-gather's, every other rank's payload
    bytes_received: int

    def advance(self) -> None:
        """Called one inner step after the send while the exchange is in flight: start what can start now."""

    def result(self) -> torch.Tensor:
        raise NotImplementedError


class CompletedMean(OuterExchange):
    """An exchange whose mean is known (restored from a checkpoint)."""

    def __init__(self, mean: torch.Tensor) -> None:
        self.mean, self.bytes_sent, self.bytes_received = mean, 0, 0

    def result(self) -> torch.Tensor:
        return self.mean


class AllReducedMean(OuterExchange):
    """fp32 / bf16 / fp16: the change cast, divided by the world size and summed by one all-reduce."""

    def __init__(
        self,
        delta: torch.Tensor,
        dtype: Optional[torch.dtype],
        group: Optional[dist.ProcessGroup],
        async_op: bool,
        what: str,
    ) -> None:
        self.payload = delta.to(dtype) if dtype is not None else delta
        self.payload.div_(dist.get_world_size(group))
        self.bytes_sent = self.bytes_received = self.payload.numel() * self.payload.element_size()
        self.group, self.what = group, what
        with waiting_for(f"every rank's {what}", group):
            self.work = dist.all_reduce(self.payload, group=group, async_op=async_op)

    def result(self) -> torch.Tensor:
        if self.work is not None:
            with waiting_for(f"the all-reduce of the {self.what} sent at an earlier step", self.group):
                self.work.wait()
            self.work = None
        return self.payload


class QuantizedMean(OuterExchange):
    """int8 / int4: blockwise-quantized codes, averaged in fp32 by an all-to-all then an all-gather (above)."""

    def __init__(
        self, delta: torch.Tensor, bits: int, group: Optional[dist.ProcessGroup], async_op: bool, what: str
    ) -> None:
        self.bits, self.group, self.what, self.async_op = bits, group, what, async_op
        self.world_size, self.numel = dist.get_world_size(group), delta.numel()
        self.chunk = -(-self.numel // (self.world_size * BLOCK)) * BLOCK  # elements each rank averages
        padded = torch.zeros(self.world_size * self.chunk, dtype=torch.float32, device=delta.device)
        padded[: self.numel] = delta.reshape(-1)
        send = quantize(padded.view(self.world_size, self.chunk), bits)
        self.bytes_sent = self.bytes_received = send.numel()
        self.received = torch.empty_like(send)
        self.gathered: Optional[list[torch.Tensor]] = None
        self.mean: Optional[torch.Tensor] = None
        with waiting_for(f"every rank's {what} (quantized, all-to-all)", group):
            self.work = dist.all_to_all_single(self.received, send, group=group, async_op=async_op)

    def advance(self) -> None:
        if self.gathered is not None:
            return
        if self.work is not None:
            with waiting_for(f"the {self.what} sent at an earlier step (quantized, all-to-all)", self.group):
                self.work.wait()
        values = dequantize(self.received, self.bits, self.chunk)  # row j: rank j's change, my chunk
        total = values[0]
        for j in range(1, self.world_size):  # rank order: the same additions on every rank
            total = total + values[j]
        mine = quantize(divide(total, self.world_size).view(1, -1), self.bits)
        self.gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        with waiting_for(f"every rank's chunk of the mean {self.what} (quantized, all-gather)", self.group):
            self.work = dist.all_gather(self.gathered, mine, group=self.group, async_op=self.async_op)

    def result(self) -> torch.Tensor:
        if self.mean is None:
            self.advance()
            if self.work is not None:
                with waiting_for(f"the mean {self.what} (quantized, all-gather)", self.group):
                    self.work.wait()
                self.work = None
            assert self.gathered is not None
            chunks = dequantize(torch.cat(self.gathered), self.bits, self.chunk)
            self.mean = chunks.reshape(-1)[: self.numel]
        return self.mean


def start_exchange(
    delta: torch.Tensor, precision: str, group: Optional[dist.ProcessGroup], async_op: bool, what: str
) -> OuterExchange:
    """Start averaging ``delta`` (flat) over the ranks of ``group`` in ``precision``; ``what`` names it in
    hang reports. A fragment of zero-element parameters has nothing to send: its (empty) mean is known at
    once, on every rank alike (the parameters' shapes are the same on every rank)."""
    if delta.numel() == 0:
        return CompletedMean(delta.reshape(-1).to(torch.float32))
    if precision in QUANTIZED_BITS:
        return QuantizedMean(delta, QUANTIZED_BITS[precision], group, async_op, what)
    return AllReducedMean(delta, FLOAT_PRECISIONS[precision], group, async_op, what)
