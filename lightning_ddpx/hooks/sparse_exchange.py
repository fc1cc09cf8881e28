"""DiLoCo's sparse, error-fed outer exchange: each tensor's chunked top-k in 2, 4 or 8 bits (SparseLoCo).

SparseLoCo (arXiv 2508.15706) sends a DiLoCo pseudo-gradient at 1-3 % density: each rank adds its
*error buffer* (what it has not sent yet) to the parameter change, keeps the ``k`` largest magnitudes of
every chunk of each tensor, sends their positions and their values in a few bits, and keeps the rest --
including the rounding of what it sent -- for the next exchange::

    acc      = error_decay * error + delta          (this rank's, per tensor)
    sent     = decode(encode(acc))                  (k per chunk, quantised)
    error   <- acc - sent
    mean     = (sent_0 + sent_1 + ... + sent_{W-1}) / W

The payload (:class:`SparseCodec`) of a tensor of ``n`` elements split into chunks of
``c = min(chunk, n)`` elements, ``k = min(c, max(1, round(density * c)))`` kept per chunk:

- ``k`` positions per chunk, ``ceil(log2 c)`` bits each (12 for chunks of 4096), packed back to back;
- ``k`` codes per chunk, ``bits`` each: value ``(2 * code - L) * scale`` with ``L = 2 ** bits - 1``, levels
  odd multiples of the scale (2 bits: -3, -1, 1, 3 -- no zero level, a kept value is never 0 by choice);
- one fp32 scale per chunk: its largest kept magnitude over ``L``.

Values cannot be summed as codes, so the payloads travel by ``all_gather`` (:class:`SparseMean`): every rank
receives the other ranks' payloads -- ``world_size - 1`` times what it sends, counted as received bytes --
and decodes all of them in rank order, adding the dense values in the same order, then divides by the
world size with :func:`~lightning_ddpx.hooks.outer_exchange.divide`. Every rank computes with the same
bits in the same order, so the mean is the same, bit for bit, on every rank and on the CPU and CUDA alike
(each step exact or correctly rounded; the decode writes positions that are distinct within a chunk, so
no scatter order matters -- unlike a ``scatter_reduce_`` mean, whose float additions CUDA orders freely).
Rounding is to nearest (ties to even), with no randomness: a resumed run repeats the same exchanges.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.option_values import check_int, is_finite_number
from lightning_ddpx.hooks.outer_exchange import OuterExchange, divide

__all__ = [
    "SPARSE_BITS",
    "SparseCodec",
    "SparseMean",
    "SparseOptions",
    "TensorChunks",
    "error_fed_payload",
    "pack_bits",
    "unpack_bits",
]

SPARSE_BITS = (2, 4, 8)


@dataclass(frozen=True)
class SparseOptions:
    """What DiLoCo's sparse exchange keeps of each tensor (``diloco={"sparse": {...}}``). Defaults: chunks
    of 4096 (SparseLoCo's 64 x 64), 2 % kept, 2-bit values, error decay 0.999 (SparseLoCo's)."""

    density: float = 0.02  # fraction of each chunk's elements sent: k = max(1, round(density * chunk))
    bits: int = 2  # bits per kept value: 2, 4 or 8
    chunk: int = 4096  # elements per top-k chunk (a smaller tensor is one chunk of its size)
    error_decay: float = 0.999  # weight of the error buffer carried into the next exchange

    def __post_init__(self) -> None:
        if not is_finite_number(self.density) or not 0 < self.density <= 1:
            raise ValueError(
                f"diloco option sparse.density must be a number in (0, 1] (the fraction of each chunk sent; "
                f"SparseLoCo uses 0.01-0.03), got {self.density!r}."
            )
        object.__setattr__(self, "density", float(self.density))
        check_int("diloco option sparse", "bits", self.bits)
        if self.bits not in SPARSE_BITS:
            raise ValueError(
                f"diloco option sparse.bits must be one of {list(SPARSE_BITS)}, got {self.bits!r}."
            )
        object.__setattr__(self, "bits", int(self.bits))
        check_int("diloco option sparse", "chunk", self.chunk, 2, hint="Elements per top-k chunk, e.g. 4096.")
        object.__setattr__(self, "chunk", int(self.chunk))
        if not is_finite_number(self.error_decay) or not 0 <= self.error_decay <= 1:
            raise ValueError(
                "diloco option sparse.error_decay must be a number in [0, 1] (0: no error feedback; "
                f"SparseLoCo uses 0.999), got {self.error_decay!r}."
            )
        object.__setattr__(self, "error_decay", float(self.error_decay))

    @classmethod
    def from_value(cls, value: Any) -> "SparseOptions":
        """``SparseOptions``, a dict of its fields (YAML), or ``True`` for the defaults."""
        if isinstance(value, SparseOptions):
            return value
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise TypeError(
                "diloco option sparse must be a dict of density, bits, chunk, error_decay (or True for the "
                f"defaults, None for a dense exchange), got {value!r} ({type(value).__name__})."
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise TypeError(f"unknown diloco option(s) sparse.{unknown}; the options of sparse are {known}.")
        return cls(**value)


# ---------------------------------------------------------------------------------------- bit packing
def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2 ** bits`` (any shape) packed back to back, low bit first, into
    ``ceil(numel * bits / 8)`` bytes (uint8)."""
    flat = values.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, device=flat.device)
    stream = ((flat.unsqueeze(1) >> shifts) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64, device=flat.device)
    return (stream.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` integers (int64) that :func:`pack_bits` packed in ``packed``."""
    shifts = torch.arange(8, device=packed.device)
    stream = ((packed.to(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * bits]
    weights = torch.tensor([1 << i for i in range(bits)], dtype=torch.int64, device=packed.device)
    return (stream.view(count, bits) * weights).sum(dim=1)


# -------------------------------------------------------------------------------------------- the codec
@dataclass(frozen=True)
class TensorChunks:
    """How one tensor of ``numel`` elements is cut: ``rows`` chunks of ``size``, ``k`` kept in each."""

    numel: int
    size: int  # elements per chunk (the last one zero-padded)
    k: int  # kept per chunk
    index_bits: int
    value_bits: int

    @classmethod
    def plan(cls, numel: int, options: SparseOptions) -> "TensorChunks":
        size = max(1, min(options.chunk, numel))
        k = min(size, max(1, round(options.density * size)))
        return cls(numel, size, k, max(1, math.ceil(math.log2(size))), options.bits)

    @property
    def rows(self) -> int:
        return -(-self.numel // self.size)

    @property
    def index_bytes(self) -> int:
        return -(-self.rows * self.k * self.index_bits // 8)

    @property
    def value_bytes(self) -> int:
        return -(-self.rows * self.k * self.value_bits // 8)

    @property
    def scale_bytes(self) -> int:
        return 4 * self.rows

    @property
    def payload_bytes(self) -> int:
        return self.index_bytes + self.value_bytes + self.scale_bytes

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (float32, flat, ``numel``) -> this tensor's payload: indices, codes, scales."""
        padded = torch.zeros(self.rows * self.size, dtype=torch.float32, device=values.device)
        padded[: self.numel] = values
        chunks = padded.view(self.rows, self.size)
        indices = chunks.abs().topk(self.k, dim=1, sorted=False).indices
        kept = chunks.gather(1, indices)
        levels = 2**self.value_bits - 1
        scales = divide(kept.abs().amax(dim=1, keepdim=True), levels)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round((kept / divisor + levels) / 2).clamp_(0, levels)
        return torch.cat(
            [
                pack_bits(indices, self.index_bits),
                pack_bits(codes.to(torch.int64), self.value_bits),
                scales.reshape(-1).contiguous().view(torch.uint8),
            ]
        )

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The dense float32 values (flat, ``numel``) that :meth:`encode` sent in ``payload``."""
        count = self.rows * self.k
        index_end = self.index_bytes
        value_end = index_end + self.value_bytes
        indices = unpack_bits(payload[:index_end], self.index_bits, count).view(self.rows, self.k)
        codes = unpack_bits(payload[index_end:value_end], self.value_bits, count).view(self.rows, self.k)
        scales = payload[value_end : value_end + self.scale_bytes].clone().view(torch.float32).view(-1, 1)
        levels = 2**self.value_bits - 1
        kept = (2 * codes - levels).to(torch.float32) * scales
        dense = torch.zeros(self.rows, self.size, dtype=torch.float32, device=payload.device)
        dense.scatter_(1, indices, kept)  # positions distinct within a row: no order to depend on
        return dense.reshape(-1)[: self.numel]


class SparseCodec:
    """The payload of a flat concatenation of tensors (one DiLoCo fragment): each tensor's
    :class:`TensorChunks` payload, back to back in order. Sizes depend on the shapes only, equal on every
    rank."""

    def __init__(self, numels: Sequence[int], options: SparseOptions) -> None:
        self.tensors = [TensorChunks.plan(n, options) for n in numels if n > 0]
        self.numels = list(numels)
        self.payload_bytes = sum(t.payload_bytes for t in self.tensors)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        parts, offset = [], 0
        for plan in self.tensors:
            parts.append(plan.encode(flat[offset : offset + plan.numel]))
            offset += plan.numel
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=flat.device)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        parts, offset = [], 0
        for plan in self.tensors:
            parts.append(plan.decode(payload[offset : offset + plan.payload_bytes]))
            offset += plan.payload_bytes
        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=payload.device)
        return torch.cat(parts)


def error_fed_payload(
    codec: SparseCodec, delta: torch.Tensor, error: torch.Tensor, decay: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, new_error)`` of one exchange: ``acc = decay * error + delta`` encoded, and what of
    ``acc`` the payload does not carry (its decode subtracted). All float32, flat."""
    acc = delta.to(torch.float32) + error * decay
    payload = codec.encode(acc)
    return payload, acc - codec.decode(payload)


# ----------------------------------------------------------------------------------------- the exchange
class SparseMean(OuterExchange):
    """Every rank's payload by one all-gather; the mean of their decodes, in rank order (see the module)."""

    def __init__(
        self,
        payload: torch.Tensor,
        codec: SparseCodec,
        group: Optional[dist.ProcessGroup],
        async_op: bool,
        what: str,
    ) -> None:
        self.codec, self.group, self.what = codec, group, what
        self.world_size = dist.get_world_size(group)
        self.bytes_sent = payload.numel()
        self.bytes_received = (self.world_size - 1) * payload.numel()
        self.gathered = [torch.empty_like(payload) for _ in range(self.world_size)]
        self.mean: Optional[torch.Tensor] = None
        with waiting_for(f"every rank's {what} (sparse, all-gather)", group):
            self.work = dist.all_gather(self.gathered, payload, group=group, async_op=async_op)

    def result(self) -> torch.Tensor:
        if self.mean is None:
            if self.work is not None:
                with waiting_for(f"the {self.what} sent at an earlier step (sparse, all-gather)", self.group):
                    self.work.wait()
                self.work = None
            total = self.codec.decode(self.gathered[0])
            for payload in self.gathered[1:]:  # rank order: the same additions on every rank
                total = total + self.codec.decode(payload)
            self.mean = divide(total, self.world_size)
            self.gathered = []
        return self.mean
