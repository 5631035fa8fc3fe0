"""Paged attention as one Triton kernel, prefill and decode alike (for GPUs; on a CPU only
under Triton's interpreter, TRITON_INTERPRET=1, which is how the CPU suite checks it).

The step's new K/V are written into their cache slots first; then every new token attends to
its sequence's context straight from the blocks (no gathered copy), causally. A program takes
up to BLOCK_M consecutive new tokens of one sequence and one query head, walks the context in
BLOCK_N-token tiles through the block table (online softmax, float32), and writes its rows.
Query head h reads kv head h // (nh / kvh), as transformers' repeat_kv. A sliding window
masks what lies at or before pos - window (and the walk starts at the first tile it reaches);
softcap caps the scaled scores with tanh before the online softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraserve.model.attention.base import AttentionBackend, AttentionSeq

BLOCK_M = 16  # new tokens per program
BLOCK_N = 16  # context tokens per tile


def dot_precision(dtype: torch.dtype) -> str:
    """The kernel's tl.dot precision: Triton's default for float32 operands is TF32, which
    rounds q, k, p and v to 10 mantissa bits, so a float32 model's attention would not be
    float32 (greedy tokens drift from the reference). bf16 / fp16 values are exact in TF32,
    and TF32 rounds p more finely than the model's dtype would."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
            q_ptr, q_row, q_head, k_ptr, v_ptr, kv_slot, o_ptr, o_row, o_head,
            tiles_ptr,  # int64 [n, 4]: sequence, first row, rows, position of the first row
            tables_ptr, table_stride, scale, block_size, group, hd, window, softcap,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HD: tl.constexpr,
            PRECISION: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(tiles_ptr + i * 4)
        row0 = tl.load(tiles_ptr + i * 4 + 1)
        nrows = tl.load(tiles_ptr + i * 4 + 2)
        pos0 = tl.load(tiles_ptr + i * 4 + 3)
        kvh = h // group
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, HD)
        m_ok = m < nrows
        d_ok = d < hd
        q = tl.load(q_ptr + (row0 + m)[:, None] * q_row + h * q_head + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        pos = pos0 + m  # each new token's position: it sees positions <= its own
        best = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HD), dtype=tl.float32)
        end = pos0 + nrows  # context tokens any row of this tile can see
        start = pos0 * 0  # int64 as pos0: compiled Triton refuses a type change in the branch
        if window > 0:  # nothing before the first row's window is seen by any row
            start = tl.maximum(pos0 - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            block = tl.load(tables_ptr + seq * table_stride + n // block_size, mask=n_ok,
                            other=0)
            slot = block * block_size + n % block_size
            kv = slot[:, None] * kv_slot + kvh * hd + d[None, :]
            k = tl.load(k_ptr + kv, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptr + kv, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
            if softcap > 0:  # softcap * tanh(s / softcap), tanh through exp (no tl.tanh)
                e = tl.exp(-2.0 * tl.abs(s / softcap))
                t = (1.0 - e) / (1.0 + e)
                s = softcap * tl.where(s < 0, -t, t)
            seen = n[None, :] <= pos[:, None]
            if window > 0:
                seen = seen & (n[None, :] > pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            # a row that has seen nothing yet (its window starts later) keeps exp(-inf) = 0
            safe = tl.where(new_best == float("-inf"), 0.0, new_best)
            p = tl.exp(s - safe[:, None])
            fix = tl.exp(best - safe)
            total = total * fix + tl.sum(p, axis=1)
            acc = acc * fix[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            best = new_best
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]  # padding rows: 0, not 0/0
        tl.store(o_ptr + (row0 + m)[:, None] * o_row + h * o_head + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])

    return paged_attention_kernel, triton.next_power_of_2


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each new token
    tiles: torch.Tensor  # int64 [n, 4]: sequence, first row, rows, position of the first row
    tables: torch.Tensor  # int64 [num seqs, max blocks]


class TritonAttention(AttentionBackend):
    def __init__(self, block_size: int, device):
        super().__init__(block_size, device)
        import os

        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend needs a CUDA device (or "
                             "TRITON_INTERPRET=1 to run it on the CPU)")
        self.kernel, self.next_pow2 = _kernels()

    def prepare(self, seqs: Sequence[AttentionSeq]) -> TritonAttentionMetadata:
        bs, dev = self.block_size, self.device
        slots, tiles = [], []
        width = max(len(s.block_table) for s in seqs)
        for i, s in enumerate(seqs):
            c, table = s.num_computed, s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + s.num_new))
            for r0 in range(0, s.num_new, BLOCK_M):
                tiles.append((i, s.start + r0, min(BLOCK_M, s.num_new - r0), c + r0))
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return TritonAttentionMetadata(torch.tensor(slots, device=dev),
                                       torch.tensor(tiles, dtype=torch.int64, device=dev),
                                       torch.tensor(tables, dtype=torch.int64, device=dev))

    # --- captured decode steps (engine/cuda_graphs.py) ------------------------------------
    def graph_metadata(self, max_seqs: int, max_blocks: int, take=None,
                       take_table=None) -> TritonAttentionMetadata:
        """Metadata of fixed shapes for decode steps of up to `max_seqs` sequences (one new
        token each) whose block tables hold up to `max_blocks` blocks. `take(*shape)` makes
        each int64 tensor and `take_table` the block table (cuda_graphs.py carves them out of
        its buffers); default: zeros on this backend's device."""
        take = take or (lambda *shape: torch.zeros(shape, dtype=torch.int64, device=self.device))
        return TritonAttentionMetadata(take(max_seqs), take(max_seqs, 4),
                                       (take_table or take)(max_seqs, max_blocks))

    @staticmethod
    def graph_metadata_view(meta: TritonAttentionMetadata, num_seqs: int):
        return TritonAttentionMetadata(meta.slot_mapping[:num_seqs], meta.tiles[:num_seqs],
                                       meta.tables[:num_seqs])

    def fill_graph_metadata(self, meta: TritonAttentionMetadata, seqs: Sequence[AttentionSeq],
                            scratch_slot: int) -> int:
        """Write a decode step into graph metadata; returns the table columns written. Rows
        past `seqs` are padding: a tile with no rows (the kernel reads and writes nothing for
        it), its K/V stored to `scratch_slot`, a cache slot no sequence owns. Table entries
        past a sequence's context are left as they were: the kernel never reads them."""
        n, width = meta.tiles.shape[0], meta.tables.shape[1]
        if len(seqs) > n or any(s.num_new != 1 or len(s.block_table) > width for s in seqs):
            raise ValueError("graph metadata takes one new token per sequence, within its size")
        bs, k = self.block_size, len(seqs)
        used = max((len(s.block_table) for s in seqs), default=1)
        slots = [s.block_table[s.num_computed // bs] * bs + s.num_computed % bs for s in seqs]
        tiles = [(i, s.start, 1, s.num_computed) for i, s in enumerate(seqs)]
        tables = [s.block_table + [0] * (used - len(s.block_table)) for s in seqs]
        # a padding tile is (its own row as sequence and first row, 0 rows)
        slots += [scratch_slot] * (n - k)
        tiles += [(i, i, 0, 0) for i in range(k, n)]
        tables += [[0] * used] * (n - k)
        slots, tiles, tables = (torch.tensor(a, dtype=torch.int64) for a in (slots, tiles, tables))
        meta.slot_mapping.copy_(slots)
        meta.tiles.copy_(tiles)
        meta.tables[:, :used].copy_(tables)
        return used

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonAttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nh, hd = q.shape[1], q.shape[2]
        if q.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
            raise ValueError("triton attention needs unit-stride heads and contiguous caches")
        grid = (meta.tiles.shape[0], nh)
        self.kernel[grid](q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0),
                          out, out.stride(0), out.stride(1), meta.tiles, meta.tables,
                          meta.tables.stride(0), scale, self.block_size,
                          nh // k_cache.shape[1], hd, window, float(softcap),
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                          HD=max(16, self.next_pow2(hd)), PRECISION=dot_precision(q.dtype))
        return out
