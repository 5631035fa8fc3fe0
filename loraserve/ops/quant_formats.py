"""Quantized weights in the layout the quantized GEMM reads (ops/qgemm_cpu.c, ops/qblock.h),
made from float32 weights (int8 per output channel; int4 as GGUF's Q4_0) or from a GGUF
tensor's own blocks (Q8_0, Q4_0, Q4_1, Q4_K), and decoded back to float32.

Every format keeps its values: a GGUF tensor's blocks are rearranged (dot order, scales apart
from the quants), never re-quantized, and `dequantize` gives exactly what gguf's own
`quants.dequantize` gives for the file (tests/kernels/test_quant_formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# qgemm_cpu.c's formats
Q8_ROW, Q8_F16, Q4_F16, Q4_AFF16, Q4_AFF32 = range(5)
GROUP = 64  # K per group: two blocks of 32
GGUF_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")


def _dot_order() -> torch.Tensor:
    """Dot byte i of a group holds element DOT_ORDER[i] (ops/qblock.h)."""
    i = torch.arange(GROUP)
    lane = i >> 2
    return 32 * (lane & 1) + 4 * (lane >> 1) + (i & 3)


DOT_ORDER = _dot_order()
NATURAL_ORDER = torch.argsort(DOT_ORDER)


@dataclass(frozen=True)
class QuantWeight:
    """A `[out_features, in_features]` weight: quants `qs` (uint8, `[N, K]` for 8-bit, `[N,
    K / 2]` for 4-bit, groups in dot order), scales `d` (`[N]` float32 for Q8_ROW, else one per
    block of 32: float16, or float32 for Q4_AFF32) and offsets `m` (affine formats)."""

    kind: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    out_features: int
    in_features: int
    source: str  # what it was made from: "int8", "int4", or the GGUF type's name

    @property
    def bits(self) -> int:
        return 8 if self.kind in (Q8_ROW, Q8_F16) else 4

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: quants, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m)
                   if t is not None)

    def quants(self) -> torch.Tensor:
        """The integer quants `[N, K]` in natural order (int8 signed, or 0..15 for 4-bit)."""
        n, k = self.out_features, self.in_features
        if self.bits == 8:
            dot = self.qs.view(torch.int8).view(n, k // GROUP, GROUP)
        else:
            packed = self.qs.view(n, k // GROUP, GROUP // 2)
            dot = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
        return dot[..., NATURAL_ORDER].reshape(n, k)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, computed as GGUF's reference decoders compute it."""
        n = self.out_features
        q = self.quants().to(torch.float32)
        if self.kind == Q8_ROW:
            return self.d.view(n, 1) * q
        return dequantize_blocks(self.kind, q, self.d, self.m)


def dequantize_blocks(kind: int, q: torch.Tensor, d: torch.Tensor,
                      m: torch.Tensor | None) -> torch.Tensor:
    """float32 `[N, K]` of a block format's quants `q` (float32 `[N, K]`, natural order) and
    its per-block scales `d` and offsets `m` (`[N, K / 32]`), as GGUF's decoders compute it."""
    n, k = q.shape
    blocks = q.view(n, k // 32, 32)
    d = d.to(torch.float32).unsqueeze(-1)
    if kind == Q4_F16:
        w = d * (blocks - 8)
    elif kind == Q8_F16:
        w = d * blocks
    else:
        w = d * blocks + m.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k)


def supports(in_features: int) -> bool:
    """Whether a weight with this many inputs can be quantized: whole groups of 64."""
    return in_features % GROUP == 0 and in_features > 0


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Quants `[N, K]` (natural order) into dot order; 4-bit ones two to a byte."""
    n, k = q.shape
    dot = q.reshape(n, k // GROUP, GROUP)[..., DOT_ORDER]
    if bits == 8:
        return dot.to(torch.int8).view(torch.uint8).reshape(n, k).contiguous()
    dot = dot.to(torch.uint8)
    return (dot[..., :32] | (dot[..., 32:] << 4)).reshape(n, k // 2).contiguous()


def _check_shape(w: torch.Tensor) -> None:
    if w.dim() != 2 or not supports(w.shape[1]):
        raise ValueError(f"a quantized weight needs in_features a multiple of {GROUP}, "
                         f"not shape {list(w.shape)}")


def quantize_int8(w: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per output row: scale amax / 127, quants rounded to nearest."""
    _check_shape(w)
    w = w.detach().to(torch.float32)
    d = w.abs().amax(dim=1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(w * inv.unsqueeze(1)).clamp_(-127, 127)
    return QuantWeight(Q8_ROW, _pack(q, 8), d.contiguous(), None, *w.shape, "int8")


def quantize_int4(w: torch.Tensor) -> QuantWeight:
    """4-bit per block of 32, as GGUF's Q4_0 quantizer makes it (the same bytes): scale =
    the block's largest-magnitude value / -8, quants trunc(w / scale + 8.5) in 0..15."""
    _check_shape(w)
    w = w.detach().to(torch.float32)
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    big = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = big / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    return QuantWeight(Q4_F16, _pack(q.reshape(n, k), 4), d.squeeze(-1).to(torch.float16),
                       None, n, k, "int4")


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGUF's 16-byte nibble runs `[..., 16]` as 32 quants: low nibbles first, then high."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def from_gguf(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
    """A GGUF tensor's blocks (`raw`: uint8, as gguf.GGUFReader gives it) for an `[N, K]`
    weight, in our layout with its values unchanged."""
    n, k = shape
    if not supports(k):
        raise ValueError(f"{qtype} weight {list(shape)}: in_features must be a multiple of "
                         f"{GROUP}")
    b = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).reshape(n, -1)

    def half(col: int, blocks: torch.Tensor) -> torch.Tensor:
        return blocks[..., col:col + 2].contiguous().view(torch.float16).squeeze(-1)

    if qtype == "Q8_0":
        blocks = b.view(n, k // 32, 34)
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return QuantWeight(Q8_F16, _pack(q, 8), half(0, blocks).contiguous(), None, n, k,
                           qtype)
    if qtype in ("Q4_0", "Q4_1"):
        size = 18 if qtype == "Q4_0" else 20
        blocks = b.view(n, k // 32, size)
        q = _nibbles(blocks[..., size - 16:]).reshape(n, k)
        m = half(2, blocks).contiguous() if qtype == "Q4_1" else None
        kind = Q4_F16 if qtype == "Q4_0" else Q4_AFF16
        return QuantWeight(kind, _pack(q, 4), half(0, blocks).contiguous(), m, n, k, qtype)
    if qtype == "Q4_K":
        if k % 256:
            raise ValueError(f"Q4_K weight {list(shape)}: in_features must be a multiple of 256")
        blocks = b.view(n, k // 256, 144)
        d, dmin = half(0, blocks).to(torch.float32), half(2, blocks).to(torch.float32)
        sc, mn = _q4k_scales(blocks[..., 4:16])
        q = _q4k_quants(blocks[..., 16:])
        ds = (d.unsqueeze(-1) * sc.to(torch.float32)).reshape(n, k // 32)
        ms = -(dmin.unsqueeze(-1) * mn.to(torch.float32)).reshape(n, k // 32)
        return QuantWeight(Q4_AFF32, _pack(q.reshape(n, k), 4), ds.contiguous(),
                           ms.contiguous(), n, k, qtype)
    raise ValueError(f"GGUF type {qtype} is not served quantized (served: "
                     f"{', '.join(GGUF_FORMATS)})")


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes `[..., 12]` as 8 six-bit scales and 8 six-bit mins."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4k_quants(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 quant bytes `[..., 128]` as 256 quants: each run of 32 bytes holds two
    sub-blocks, the low nibbles the first, the high nibbles the second."""
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([runs & 0x0F, runs >> 4], dim=-2).reshape(*qs.shape[:-1], 256)
