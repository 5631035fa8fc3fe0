"""Segmented multi-LoRA shrink and expand as Triton kernels (SGMV, as in Punica / S-LoRA),
over the slot pool's packed layout (adapters/slot_pool.py, lora/layout.py).

Imported only by the `triton` backend: triton stays optional. On a CPU, the kernels run under
Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is imported): that is how the
CPU test suite checks them against the reference.

Work is listed per token block on the host (the plan), so a launch has exactly as many
programs as there are blocks of adapter tokens: base-model rows cost nothing, and a segment
costs its own packed rank, never max_lora_rank.
- shrink: program (block i, rank tile j, part k of d_in) computes the partial sum
  t[k, rows, 64j:64j+64] = x[rows, K_k] @ A_s.T[K_k] for the 64-column tile j of slot s's A.T
  ([d_in, w] row-major at c0 * d_in into the slot); tiles past the segment's padded rank exit
  at once. bf16 / fp16 operands multiply as they are, float32 ones in IEEE precision.
- expand: program (block-part i, column block j: the part's columns n0 = 64 * STRIPS * j and
  on) sums t's parts in order and adds t[rows, o0:o0+r] @ B.T[:, n0:n0 + 64 * STRIPS]
  into y[rows, c0+n0:...], B.T's strip k stored [r, w] row-major at boff + 64k * r. Parts of
  one segment write disjoint columns and segments disjoint rows: no two programs add to the
  same element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per program
# Tokens per program in a step whose segments are long (prompts), where each A tile and B
# strip is then read once per LONG_BLOCK_M rows instead of once per BLOCK_M; never in a
# captured graph (see rows_per_program).
LONG_BLOCK_M = 64
TILE = 64  # layout.RANK_TILE and layout.B_STRIP: the packed layout's tile widths
BLOCK_K = 128  # d_in per iteration of the shrink
K_CHUNK = 1024  # d_in per shrink program (k_splits)
# 64-column strips per expand program (a power of two), multiplied as one [BLOCK_M, strips x
# 64] product. In a replayed graph the grid is sized for the worst case (every token its own
# part, the widest module), so most programs exit at once; more strips per program launch
# fewer of them. Each column's sum is the same whatever the value.
EXPAND_STRIPS = 1
# Rank rows of B per step of the expand's reduction, at most: the reduction walks a module's
# rank in steps of min(this, the pool's max_lora_rank rounded up to a power of two), so a
# rank-64 part takes one dependent step instead of four. The step depends on the pool alone,
# never on the batch, so a token's sum is the same whatever adapters share its step.
EXPAND_RANK_BLOCK = 64


@triton.jit
def sgmv_shrink_kernel(x_ptr, x_stride, t_ptr, t_stride, t_split_stride, a_ptr, a_slot_stride,
                       d_in, k_chunk,
                       blocks_ptr,  # int64 [n, 4]: slot, row0, row1, padded rank
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr,
                       NATIVE: tl.constexpr, PRECISION: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(blocks_ptr + i * 4)
    row0 = tl.load(blocks_ptr + i * 4 + 1)
    row1 = tl.load(blocks_ptr + i * 4 + 2)
    rp = tl.load(blocks_ptr + i * 4 + 3)
    c0 = j * TILE
    if c0 < rp:
        # this tile's width. Packed ranks are padded to RANK_ALIGN (8): rounding rp down to a
        # multiple of 8 changes nothing and tells the compiler, so its rows load as vectors.
        w = tl.minimum(rp // 8 * 8 - c0, TILE)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, TILE)
        row_ok = rows < row1
        col_ok = cols < w
        tile = a_ptr + slot * a_slot_stride + c0 * d_in  # [d_in, w] row-major
        k_end = tl.minimum(split * k_chunk + k_chunk, d_in)
        acc = tl.zeros((BLOCK_M, TILE), dtype=tl.float32)
        for k0 in range(split * k_chunk, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            xb = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            ab = tl.load(tile + ks[:, None] * w + cols[None, :],
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if NATIVE:  # bf16 / fp16 products are exact in the float32 accumulator
                acc += tl.dot(xb, ab)
            else:
                acc += tl.dot(xb.to(tl.float32), ab.to(tl.float32), input_precision=PRECISION)
        tl.store(t_ptr + split * t_split_stride + rows[:, None] * t_stride + (c0 + cols)[None, :],
                 acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def sgmv_expand_kernel(t_ptr, t_stride, t_split_stride, n_splits, y_ptr, y_stride, b_ptr,
                       b_slot_stride,
                       parts_ptr,  # int64 [n, 8]: slot, row0, row1, o0, r, c0, n_cols, boff
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, TILE: tl.constexpr,
                       PRECISION: tl.constexpr, STRIPS: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(parts_ptr + i * 8)
    row0 = tl.load(parts_ptr + i * 8 + 1)
    row1 = tl.load(parts_ptr + i * 8 + 2)
    o0 = tl.load(parts_ptr + i * 8 + 3)
    r = tl.load(parts_ptr + i * 8 + 4)
    c0 = tl.load(parts_ptr + i * 8 + 5)
    n_cols = tl.load(parts_ptr + i * 8 + 6)
    boff = tl.load(parts_ptr + i * 8 + 7)
    # A part whose B block, strips and output columns all start on 8-element lines (every
    # part of a model whose widths are multiples of 8) takes the same path with that said
    # (x // 8 * 8 == x there: new values, so the other path's stay unsaid), so its B and y
    # load and store as vectors; the sums are the same either way.
    s0 = tl.program_id(1) * (STRIPS * TILE)
    if (boff % 8 == 0) & (c0 % 8 == 0) & (n_cols % 8 == 0):
        _expand_columns(t_ptr, t_stride, t_split_stride, n_splits, y_ptr, y_stride, b_ptr,
                        b_slot_stride, slot, row0, row1, o0, r, c0 // 8 * 8, n_cols // 8 * 8,
                        boff // 8 * 8, s0, BLOCK_M, BLOCK_R, TILE, STRIPS * TILE, PRECISION)
    else:
        _expand_columns(t_ptr, t_stride, t_split_stride, n_splits, y_ptr, y_stride, b_ptr,
                        b_slot_stride, slot, row0, row1, o0, r, c0, n_cols, boff, s0,
                        BLOCK_M, BLOCK_R, TILE, STRIPS * TILE, PRECISION)


@triton.jit
def _expand_columns(t_ptr, t_stride, t_split_stride, n_splits, y_ptr, y_stride, b_ptr,
                    b_slot_stride, slot, row0, row1, o0, r, c0, n_cols, boff, s0,
                    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, TILE: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Columns [s0, s0 + BLOCK_N) of one part, whole strips, in one product:
    y[rows, c0 + cols] += t[rows, o0:o0+r] @ B.T[:, cols]."""
    if s0 < n_cols:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = s0 + tl.arange(0, BLOCK_N)  # of the part
        row_ok = rows < row1
        col_ok = cols < n_cols
        first = cols // TILE * TILE  # each column's strip: its first column and its width
        w = tl.minimum(n_cols - first, TILE)
        b_at = b_ptr + slot * b_slot_stride + boff + first * r + (cols - first)  # + row * w
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, r, BLOCK_R):
            ks = k0 + tl.arange(0, BLOCK_R)
            k_ok = ks < r
            t_at = t_ptr + rows[:, None] * t_stride + (o0 + ks)[None, :]
            t_ok = row_ok[:, None] & k_ok[None, :]
            tb = tl.load(t_at, mask=t_ok, other=0.0)
            for split in range(1, n_splits):  # the shrink's partial sums, in a fixed order
                tb += tl.load(t_at + split * t_split_stride, mask=t_ok, other=0.0)
            bb = tl.load(b_at[None, :] + ks[:, None] * w[None, :],
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(tb, bb.to(tl.float32), input_precision=PRECISION)
        out = y_ptr + rows[:, None] * y_stride + (c0 + cols)[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def precision(dtype: torch.dtype) -> str:
    """tl.dot's precision for activations of `dtype`. float32: "ieee", since TF32 (Triton's
    default for float32) rounds to 10 mantissa bits, far off the float32 reference the CPU
    backends match (tests/kernels/test_lora_backends.py). bf16 and fp16 fit TF32 exactly, and
    their outputs round far coarser than TF32 rounds t, so their tensor-core TF32 stays."""
    return "ieee" if dtype == torch.float32 else "tf32"


def k_splits(d_in: int) -> int:
    """Parts the shrink's reduction over d_in is cut into, each its own program. A decode step
    has a few tokens per adapter, so without the cut a handful of programs would each walk all
    of d_in alone. It depends on d_in only, never on the batch: a token's t is summed in the
    same order in every step, eager or replayed."""
    return triton.cdiv(d_in, K_CHUNK)


def rows_per_program(segment_lengths: list[int]) -> int:
    """BLOCK_M, or LONG_BLOCK_M where the segments average at least that many tokens."""
    n = len(segment_lengths)
    return LONG_BLOCK_M if n and sum(segment_lengths) >= n * LONG_BLOCK_M else BLOCK_M


def launch_shrink(x, t, group_A, blocks, num_blocks: int, max_rp: int, d_in: int,
                  block_m: int = BLOCK_M) -> None:
    """t: [k_splits(d_in), T, >= max_rp] float32, the partial sums of each part of d_in."""
    native = x.dtype == group_A.dtype and x.dtype in (torch.bfloat16, torch.float16)
    grid = (num_blocks, triton.cdiv(max_rp, TILE), t.shape[0])
    sgmv_shrink_kernel[grid](x, x.stride(0), t, t.stride(1), t.stride(0), group_A,
                             group_A.stride(0), d_in, K_CHUNK, blocks, BLOCK_M=block_m,
                             BLOCK_K=BLOCK_K, TILE=TILE, NATIVE=native,
                             PRECISION=precision(x.dtype))


def rank_block(max_lora_rank: int) -> int:
    """The expand's reduction step over the rank (EXPAND_RANK_BLOCK); tl.dot needs >= 16."""
    return max(16, min(EXPAND_RANK_BLOCK, triton.next_power_of_2(max_lora_rank)))


def launch_expand(t, y, group_B, parts, num_parts: int, max_cols: int,
                  max_lora_rank: int, block_m: int = BLOCK_M) -> None:
    if EXPAND_STRIPS & (EXPAND_STRIPS - 1):
        raise ValueError(f"EXPAND_STRIPS must be a power of two, not {EXPAND_STRIPS}")
    grid = (num_parts, triton.cdiv(max_cols, TILE * EXPAND_STRIPS))
    sgmv_expand_kernel[grid](t, t.stride(1), t.stride(0), t.shape[0], y, y.stride(0), group_B,
                             group_B.stride(0), parts, BLOCK_M=block_m,
                             BLOCK_R=rank_block(max_lora_rank), TILE=TILE,
                             PRECISION=precision(y.dtype), STRIPS=EXPAND_STRIPS)
