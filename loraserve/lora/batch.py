"""Per-step LoRA metadata: which contiguous token ranges use which adapter slot.

Built once per step and reused by every layer and group, so the per-call work in
lora/ops.py is a loop over precomputed index tuples. The runner orders sequences so the
tokens of one adapter are contiguous; adjacent runs of the same slot are merged here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loraserve.lora.layout import GROUP_NAMES, GroupLayout, Part, padded_rank

# One expand part as indices: (t_idx, y_idx, b_idx, block shape); t_idx/y_idx None = the whole
# tensor; group_B[b_idx].view(shape) is the module's block of B.
PartIndex = tuple[tuple | None, tuple | None, tuple, tuple[int, int]]
# One tile of a slot's shrink weights: group_A[idx].view(shape) is a [d_in, w] block of A.T;
# the tiles of a segment, in order, hold its rank columns [0, padded rank).
TileIndex = tuple[tuple, tuple[int, int]]
# One segment of one group: (token slice, A.T tiles, expand parts).
SegmentPlan = tuple[slice, tuple[TileIndex, ...], tuple[PartIndex, ...]]
# The C kernel's segments of one group (lora/sgmv_cpu.c; the engine sends it every segment):
# int64 (slot, start, end, rank) rows, int64 (segment, o0, o1, c0, c1, boff) rows, and the
# widest rank.
KernelPlan = tuple[torch.Tensor, torch.Tensor, int]


class SlotRanks(Protocol):
    """What the batch needs from the slot pool (adapters/slot_pool.LoraSlotPool)."""

    layouts: dict[str, GroupLayout]

    def rank(self, slot: int, group: str) -> int: ...

    def a_tiles(self, slot: int, group: str) -> tuple[tuple[int, int, int], ...]: ...

    def parts(self, slot: int, group: str) -> tuple[Part, ...]: ...


@dataclass(frozen=True)
class LoraBatch:
    num_tokens: int
    # (slot, start, end) for every LoRA segment, in token order; base tokens are not listed
    segments: tuple[tuple[int, int, int], ...]
    # packed rank per slot present in the batch and group (0: slot does not touch the group)
    ranks: dict[int, dict[str, int]] = field(default_factory=dict)
    # per group: the segments with a nonzero rank there, as ready-made index tuples
    plans: dict[str, tuple[SegmentPlan, ...]] = field(default_factory=dict)
    # per group: the segments of at most `kernel_max_tokens` tokens, for the C kernel (those
    # are then absent from `plans`)
    kernel_plans: dict[str, KernelPlan] = field(default_factory=dict)
    # the torch path runs its matmuls through oneDNN (model/linear.py), not torch.mm
    onednn: bool = False

    @property
    def is_empty(self) -> bool:
        """No token uses an adapter: every LoRA op returns at once."""
        return not self.segments

    @classmethod
    def empty(cls, num_tokens: int) -> LoraBatch:
        return cls(num_tokens, ())

    @classmethod
    def build(cls, seq_slots: Sequence[tuple[int | None, int]], pool: SlotRanks,
              kernel_max_tokens: int = 0, onednn: bool = False) -> LoraBatch:
        """seq_slots: (slot or None/-1 for the base model, num_tokens) per sequence, in batch
        order. Ranks and expand parts are read from `pool` now, so rewriting a slot while
        this batch is alive is a caller bug (the store never does it mid-step).
        kernel_max_tokens: segments up to this many tokens go to the C kernel (0: none).
        onednn: the other segments' matmuls go through oneDNN (gemm_backend() == "onednn")."""
        runs: list[list[int]] = []  # [slot, start, end]; slot -1 = base
        pos = 0
        for slot, n in seq_slots:
            if n < 0:
                raise ValueError(f"negative token count {n}")
            s = -1 if slot is None or slot < 0 else slot
            if n and runs and runs[-1][0] == s and runs[-1][2] == pos:
                runs[-1][2] += n
            elif n:
                runs.append([s, pos, pos + n])
            pos += n
        segments = tuple((s, a, b) for s, a, b in runs if s >= 0)
        if not segments:
            return cls.empty(pos)
        slots = sorted({s for s, _, _ in segments})
        ranks = {s: {g: pool.rank(s, g) for g in GROUP_NAMES} for s in slots}
        plans, kernel_plans = {}, {}
        for g in GROUP_NAMES:
            d_in, d_out = pool.layouts[g].d_in, pool.layouts[g].d_out
            plan, k_segs, k_parts = [], [], []
            for s, a, b in segments:
                r = ranks[s][g]
                if not r:
                    continue
                if b - a <= kernel_max_tokens:
                    k_parts += [(len(k_segs), o0, o1, c0, c1, boff)
                                for o0, o1, c0, c1, boff in pool.parts(s, g)]
                    k_segs.append((s, a, b, r))
                else:
                    parts = _part_indices(s, r, d_out, pool.parts(s, g))
                    tiles = tuple(((s, slice(off, off + d_in * w)), (d_in, w))
                                  for _, w, off in pool.a_tiles(s, g))
                    plan.append((slice(a, b), tiles, parts))
            if plan:
                plans[g] = tuple(plan)
            if k_segs:
                kernel_plans[g] = (torch.tensor(k_segs, dtype=torch.int64),
                                   torch.tensor(k_parts, dtype=torch.int64),
                                   max(r for *_, r in k_segs))
        return cls(pos, segments, ranks, plans, kernel_plans, onednn)

    def token_slots(self) -> list[int]:
        """Slot per token (-1 = base); for references and debugging, not the hot path."""
        out = [-1] * self.num_tokens
        for s, a, b in self.segments:
            out[a:b] = [s] * (b - a)
        return out


def _part_indices(slot: int, r: int, d_out: int, parts: tuple[Part, ...]) -> tuple[PartIndex, ...]:
    out = []
    for o0, o1, c0, c1, boff in parts:
        all_rows, all_cols = (o0, o1) == (0, padded_rank(r)), (c0, c1) == (0, d_out)  # t is padded
        t_idx = None if all_rows else (slice(None), slice(o0, o1))
        y_idx = None if all_cols else (slice(None), slice(c0, c1))
        b_idx = (slot, slice(boff, boff + (o1 - o0) * (c1 - c0)))
        out.append((t_idx, y_idx, b_idx, (o1 - o0, c1 - c0)))
    return tuple(out)
