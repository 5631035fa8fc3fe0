"""The element-wise steps of a decoder layer as Triton kernels, for GPU tensors: residual add +
RMSNorm, SiLU-and-multiply and rotary embedding, one kernel each where torch launches two to
six. A small model's decode step on a GPU is a few hundred short kernels, so each one left out
shortens the step (and each replayed CUDA graph) by its launch and its pass over memory.

Each kernel rounds where transformers' modules round (products and sums in float32, each
rounded to the tensors' dtype where the torch op would round it), so its results are those
of the torch expressions in ops/elementwise.py but for the last bit that exp's and the RMS
sum's own rounding may move.

Imported by ops/elementwise.py only when a GPU tensor arrives: triton stays optional. The CPU
suite runs the kernels under Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(h_ptr, h_row, r_ptr, r_row, alpha, w_ptr, out_ptr, out_row, d, eps,
                        HAS_R: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    x = tl.load(h_ptr + t * h_row + cols, mask=ok, other=0.0)
    if HAS_R:  # h.add_(r, alpha=alpha): in float32, rounded to h's dtype
        r = tl.load(r_ptr + t * r_row + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + alpha * r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + t * h_row + cols, x, mask=ok)
    if HAS_W:  # weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), as transformers' RMSNorm
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / d + eps)
        y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * out_row + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_kernel(gu_ptr, gu_row, out_ptr, out_row, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + t * gu_row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * gu_row + inter + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu(gate), rounded
    tl.store(out_ptr + t * out_row + cols, (s * u).to(dt), mask=ok)


@triton.jit
def rope_kernel(x_ptr, x_row, x_head, heads, half, pos_ptr, cos_ptr, sin_ptr, table_row,
                HALF: tl.constexpr, HEADS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t)
    h = tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, HALF)[None, :]
    ok = (h < heads) & (j < half)
    j_ok = j < half
    lo = x_ptr + t * x_row + h * x_head + j
    dt = x_ptr.dtype.element_ty
    x1 = tl.load(lo, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(lo + half, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + p * table_row + j, mask=j_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + p * table_row + half + j, mask=j_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + p * table_row + j, mask=j_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + p * table_row + half + j, mask=j_ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): each product rounded
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(lo, y1, mask=ok)
    tl.store(lo + half, y2, mask=ok)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def add_rms_norm(h: torch.Tensor, r: torch.Tensor | None, alpha: float,
                 weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """h += alpha * r in place (when r is given), then rms_norm(h, weight) (h itself when
    weight is None). h, r: [T, d] with unit inner stride; weight: [d] contiguous."""
    out = h if weight is None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if h.shape[0] == 0:
        return out
    block = triton.next_power_of_2(h.shape[1])
    add_rms_norm_kernel[(h.shape[0],)](
        h, h.stride(0), h if r is None else r, 0 if r is None else r.stride(0), float(alpha),
        h if weight is None else weight, out, out.stride(0), h.shape[1], float(eps),
        HAS_R=r is not None, HAS_W=weight is not None, BLOCK=block, num_warps=_warps(block))
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """F.silu(gate) * up for gate, up = gate_up.split(inter, -1): [T, 2*inter] -> [T, inter]."""
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, block))](
        gate_up, gate_up.stride(0), out, out.stride(0), inter, BLOCK=block)
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place (rotate-half): x [T, heads, hd] with unit inner stride;
    cos, sin [P, hd] contiguous; positions int64 [T] on x's device."""
    t, heads, hd = x.shape
    if t == 0:
        return x
    rope_kernel[(t,)](x, x.stride(0), x.stride(1), heads, hd // 2, positions, cos, sin,
                      cos.stride(0), HALF=triton.next_power_of_2(hd // 2),
                      HEADS=triton.next_power_of_2(heads))
    return x
