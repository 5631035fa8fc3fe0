"""Per-step LoRA metadata, the same for every backend: which contiguous token ranges use
which adapter slot, and each slot's packed rank per module group.

Built once per step and reused by every layer and group. The runner orders sequences so the
tokens of one adapter are contiguous; adjacent runs of the same slot are merged here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loraserve.lora.extras import AdapterExtras
from loraserve.lora.layout import GROUP_NAMES, GroupLayout, Part


class SlotWeights(Protocol):
    """What the LoRA op needs from the slot pool (adapters/slot_pool.LoraSlotPool)."""

    layouts: dict[str, GroupLayout]
    max_lora_rank: int
    A: list[dict[str, torch.Tensor]]  # per layer, per group: [S, R_g * d_in]
    B: list[dict[str, torch.Tensor]]  # per layer, per group: [S, max_rank * d_out_g]
    generation: int  # bumped each time A and B are replaced by bigger tensors (the pool grows)
    dtype: torch.dtype
    device: torch.device
    tile_width: int  # of A tiles and B strips (layout.py)
    extras: list[AdapterExtras | None]  # per slot: parts beyond B @ A (lora/extras.py)

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

    @property
    def is_empty(self) -> bool:
        """No token uses an adapter."""
        return not self.segments

    @classmethod
    def build(cls, seq_slots: Sequence[tuple[int | None, int]], weights: SlotWeights) -> LoraBatch:
        """seq_slots: (slot or None/-1 for the base model, num_tokens) per sequence, in batch
        order. Ranks are read from `weights` now, so rewriting a slot while this batch is
        alive is a caller bug (the store never does it mid-step)."""
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
        ranks = {s: {g: weights.rank(s, g) for g in GROUP_NAMES}
                 for s in sorted({s for s, _, _ in segments})}
        return cls(pos, segments, ranks)

    def group_segments(self, group: str) -> list[tuple[int, int, int, int]]:
        """(slot, start, end, packed rank) of the segments that touch `group`."""
        return [(s, a, b, self.ranks[s][group]) for s, a, b in self.segments
                if self.ranks[s][group]]

    def token_slots(self) -> list[int]:
        """Slot per token (-1 = base); for references and debugging, not the hot path."""
        out = [-1] * self.num_tokens
        for s, a, b in self.segments:
            out[a:b] = [s] * (b - a)
        return out
