"""Quantized weight layouts: GGUF blocks (made by gguf's own quantizers, and Q4_K blocks of
random bytes in llama.cpp's layout) decode exactly to what gguf's reference decoder gives;
int4 is GGUF's Q4_0 byte for byte; int8 per channel keeps every row within half a step."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from loraserve.ops import quant_formats as qf

N, K = 48, 512


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[3] = 0.0  # an all-zero row: scale 0, no division by it
    w[5, :32] = 0.0  # an all-zero block
    return w


def _gguf(qtype: str, w: torch.Tensor) -> np.ndarray:
    return gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, qtype))


def _reference(qtype: str, raw: np.ndarray) -> torch.Tensor:
    t = getattr(gguf.GGMLQuantizationType, qtype)
    return torch.from_numpy(gguf.quants.dequantize(raw, t).astype(np.float32))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_decode_exactly(qtype):
    raw = _gguf(qtype, _weight())
    q = qf.from_gguf(qtype, raw, (N, K))
    assert q.source == qtype and (q.out_features, q.in_features) == (N, K)
    assert torch.equal(q.dequantize(), _reference(qtype, raw))


def random_q4k(n: int, k: int, seed: int) -> np.ndarray:
    """Q4_K blocks of random bytes (any bytes are a valid block) with finite, small d and dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, size=(n, k // 256, 2)).astype(np.float16)
    raw[..., 0:4] = scales.view(np.uint8).reshape(n, k // 256, 4)
    return raw.reshape(n, -1)


def test_q4k_blocks_decode_exactly():
    raw = random_q4k(N, K, 1)
    q = qf.from_gguf("Q4_K", raw, (N, K))
    assert q.kind == qf.Q4_AFF32
    assert torch.equal(q.dequantize(), _reference("Q4_K", raw))


def test_int4_is_gguf_q4_0_byte_for_byte():
    w = _weight(2)
    ours, theirs = qf.quantize_int4(w), qf.from_gguf("Q4_0", _gguf("Q4_0", w), (N, K))
    assert torch.equal(ours.qs, theirs.qs) and torch.equal(ours.d, theirs.d)
    assert ours.kind == theirs.kind == qf.Q4_F16
    assert ours.nbytes == N * K // 2 + N * K // 32 * 2


def test_int8_per_channel_is_within_half_a_step():
    w = _weight(3)
    q = qf.quantize_int8(w)
    assert q.kind == qf.Q8_ROW and q.d.shape == (N,) and q.nbytes == N * K + N * 4
    step = q.d.unsqueeze(1)
    assert torch.all((q.dequantize() - w).abs() <= step / 2 + 1e-7)
    assert torch.equal(q.dequantize()[3], torch.zeros(K))
    assert int(q.quants().abs().max()) <= 127


def test_dot_order_packs_and_unpacks():
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    assert torch.equal(qf.QuantWeight(qf.Q8_F16, qf._pack(q, 8), torch.ones(N, K // 32),
                                      None, N, K, "t").quants(), q)
    q4 = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    assert torch.equal(qf.QuantWeight(qf.Q4_F16, qf._pack(q4, 4), torch.ones(N, K // 32),
                                      None, N, K, "t").quants(), q4)


def test_shapes_and_types_not_served_are_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        qf.quantize_int8(torch.randn(4, 96))
    with pytest.raises(ValueError, match="multiple of 64"):
        qf.from_gguf("Q8_0", _gguf("Q8_0", torch.randn(4, 96)), (4, 96))
    with pytest.raises(ValueError, match="multiple of 256"):
        qf.from_gguf("Q4_K", random_q4k(4, 256, 0)[:, :144], (4, 320))
    with pytest.raises(ValueError, match="Q6_K is not served"):
        qf.from_gguf("Q6_K", np.zeros((4, 210), np.uint8), (4, 256))
