"""The sparse outer exchange's codec in one process: packing, top-k per chunk, quantised values, the error
feedback's bookkeeping, the payload's stated size, and the mean through a one-rank all-gather."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ddpx.hooks.sparse_exchange import (
    SparseCodec,
    SparseMean,
    SparseOptions,
    TensorChunks,
    error_fed_payload,
    pack_bits,
    unpack_bits,
)
from tests.dist_utils import one_rank_group


@pytest.mark.parametrize("bits", [1, 2, 3, 6, 8, 12, 13])
def test_unpack_bits_inverts_pack_bits_and_uses_the_stated_bytes(bits: int) -> None:
    generator = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (37,), generator=generator)
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(37 * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, 37), values)


def test_pack_bits_puts_the_low_bit_first() -> None:
    assert pack_bits(torch.tensor([1, 2, 3]), 2).tolist() == [0b111001]


def _chunks(numel: int, **options) -> TensorChunks:
    return TensorChunks.plan(numel, SparseOptions(**options))


@pytest.mark.parametrize(
    ("numel", "options", "rows", "size", "k", "index_bits"),
    [
        (10_000, {"density": 0.02, "chunk": 4096}, 3, 4096, 82, 12),
        (10, {"density": 0.02, "chunk": 4096}, 1, 10, 1, 4),  # a small tensor: one chunk of its own size
        (64, {"density": 1.0, "chunk": 64}, 1, 64, 64, 6),
        (1, {"density": 0.5, "chunk": 64}, 1, 1, 1, 1),
    ],
)
def test_the_plan_cuts_chunks_keeps_k_and_states_its_bytes(numel, options, rows, size, k, index_bits) -> None:
    for bits in (2, 4, 8):
        plan = _chunks(numel, bits=bits, **options)
        assert (plan.rows, plan.size, plan.k, plan.index_bits) == (rows, size, k, index_bits)
        expected = math.ceil(rows * k * index_bits / 8) + math.ceil(rows * k * bits / 8) + 4 * rows
        assert plan.payload_bytes == expected
        payload = plan.encode(torch.randn(numel))
        assert payload.dtype == torch.uint8 and payload.numel() == expected


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_decode_keeps_each_chunks_largest_magnitudes_on_the_levels_of_its_scale(bits: int) -> None:
    torch.manual_seed(bits)
    plan = _chunks(1000, density=0.05, chunk=256, bits=bits)  # 4 chunks (the last padded), 13 kept each
    values = torch.randn(1000)
    decoded = plan.decode(plan.encode(values))
    padded = torch.cat([values, torch.zeros(24)]).view(4, 256)
    dense = torch.cat([decoded, torch.zeros(24)]).view(4, 256)
    levels = 2**bits - 1
    for row in range(4):
        top = padded[row].abs().topk(13).indices
        assert set(dense[row].nonzero().flatten().tolist()) <= set(top.tolist())
        scale = padded[row, top].abs().max() / levels
        kept = padded[row, top]
        expected = (torch.round((kept / scale + levels) / 2).clamp(0, levels) * 2 - levels) * scale
        torch.testing.assert_close(dense[row, top], expected, rtol=1e-6, atol=0)
        # the largest magnitude is sent exactly, every kept value within half a step of its level
        assert dense[row].abs().max() == pytest.approx(float(scale * levels), rel=1e-6)
        assert (dense[row, top] - kept).abs().max() <= scale * (1 + 1e-5)


def test_decode_of_encode_is_the_same_bits_every_time_and_a_zero_chunk_sends_zeros() -> None:
    codec = SparseCodec([300, 0, 5000, 7], SparseOptions(density=0.03, chunk=1024, bits=2))
    flat = torch.randn(5307)
    flat[300:1324] = 0.0  # one all-zero chunk: scale 0, decoded as zeros
    payload = codec.encode(flat)
    assert payload.numel() == codec.payload_bytes
    assert torch.equal(codec.encode(flat.clone()), payload)
    decoded = codec.decode(payload)
    assert torch.equal(codec.decode(payload.clone()), decoded)
    assert decoded.shape == (5307,) and not decoded[300:1324].any()


def test_what_is_sent_plus_the_new_error_is_the_input_plus_the_decayed_old_error() -> None:
    torch.manual_seed(0)
    codec = SparseCodec([4096, 33], SparseOptions(density=0.02, chunk=4096, bits=2))
    delta, error = torch.randn(4129), torch.randn(4129)
    for decay in (1.0, 0.999, 0.0):
        payload, new_error = error_fed_payload(codec, delta, error, decay)
        sent = codec.decode(payload)
        accumulated = delta + error * decay
        unsent = sent == 0
        assert torch.equal(new_error[unsent], accumulated[unsent])  # not sent: carried over exactly
        torch.testing.assert_close(sent + new_error, accumulated, rtol=0, atol=1e-6)
        assert unsent.sum() == 4129 - (82 + 1)  # k = 82 of the 4096 chunk, 1 of the 33


def test_error_feedback_sends_everything_eventually() -> None:
    """With no decay and no new change, the error buffer drains: what was held back goes out later."""
    codec = SparseCodec([512], SparseOptions(density=0.1, chunk=512, bits=8))
    delta = torch.randn(512)
    payload, error = error_fed_payload(codec, delta, torch.zeros(512), 1.0)
    total = codec.decode(payload)
    for _ in range(40):
        payload, error = error_fed_payload(codec, torch.zeros(512), error, 1.0)
        total += codec.decode(payload)
    torch.testing.assert_close(total, delta, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"density": 0}, ValueError, r"sparse.density must be a number in \(0, 1\]"),
        ({"density": 1.5}, ValueError, r"sparse.density must be a number in \(0, 1\]"),
        ({"density": "0.1"}, ValueError, "sparse.density"),
        ({"bits": 3}, ValueError, r"sparse.bits must be one of \[2, 4, 8\]"),
        ({"bits": 2.0}, TypeError, "diloco option sparse: bits must be an integer"),
        ({"chunk": 1}, ValueError, "diloco option sparse: chunk must be >= 2"),
        ({"chunk": True}, TypeError, "diloco option sparse: chunk must be an integer"),
        ({"error_decay": 1.1}, ValueError, r"sparse.error_decay must be a number in \[0, 1\]"),
        ({"error_decay": float("nan")}, ValueError, "sparse.error_decay"),
    ],
)
def test_bad_sparse_options_name_the_option(options, error, match) -> None:
    with pytest.raises(error, match=match):
        SparseOptions(**options)


def test_sparse_options_from_a_dict_true_or_refused_by_name() -> None:
    assert SparseOptions.from_value({"density": 0.01}) == SparseOptions(density=0.01)
    assert SparseOptions.from_value(True) == SparseOptions()
    with pytest.raises(TypeError, match=r"unknown diloco option\(s\) sparse.\['dens'\]"):
        SparseOptions.from_value({"dens": 0.01})
    with pytest.raises(TypeError, match="diloco option sparse must be a dict"):
        SparseOptions.from_value(0.02)


def test_the_mean_of_one_rank_is_its_decode_and_counts_what_travels() -> None:
    codec = SparseCodec([2000], SparseOptions(density=0.02, chunk=512, bits=4))
    payload = codec.encode(torch.randn(2000))
    with one_rank_group():
        exchange = SparseMean(payload, codec, None, async_op=True, what="test change")
        assert torch.equal(exchange.result(), codec.decode(payload))
    assert (exchange.bytes_sent, exchange.bytes_received) == (codec.payload_bytes, 0)
