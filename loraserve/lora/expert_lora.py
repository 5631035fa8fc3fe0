"""One adapter's LoRA on the experts of one mixture-of-experts layer, and where its rows sit
in the layer's expert-sorted rows (model/moe.py runs the grouped GEMM and calls `add` inside
each expert's group, for the run of rows of each adapter).

Kept in float32 like the other parts beyond the packed groups (lora/extras.py): the delta is
computed in float32 and added to the expert's output in its dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLora:
    """Per part ("gate_up", "down"): (A [E, r, d_in], B [E, d_out, r] with the scale in)."""

    parts: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def add(self, part: str, expert: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [n, d_out] += (x [n, d_in] @ A_e.T) @ B_e.T, in place (model/moe.ExpertDelta)."""
        ab = self.parts.get(part)
        if ab is None or x.shape[0] == 0:
            return
        a, b = ab[0][expert], ab[1][expert]
        if y.dtype == a.dtype:  # the expand accumulates into y: one op, no temporary
            y.addmm_(x @ a.T, b.T)
        else:
            y += ((x.to(a.dtype) @ a.T) @ b.T).to(y.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ab in self.parts.values() for t in ab)

    def to(self, device: torch.device) -> ExpertLora:
        return ExpertLora({p: (a.to(device), b.to(device)) for p, (a, b) in self.parts.items()})


def expert_runs(segments: Sequence[tuple[int, int, ExpertLora]], token_of_row: torch.Tensor,
                bounds: Sequence[int]) -> list[list[tuple[int, int, ExpertLora]]]:
    """Per expert, (first row, end row, lora) of each token segment [t0, t1) with expert LoRA.
    Rows are sorted by expert and, within an expert, by token (model/moe.py), so a segment's
    rows in expert e are those whose key e * T + token lies in [e * T + t0, e * T + t1)."""
    num_experts = len(bounds) - 1
    runs: list[list[tuple[int, int, ExpertLora]]] = [[] for _ in range(num_experts)]
    if not segments or token_of_row.numel() == 0:
        return runs
    dev = token_of_row.device
    span = int(token_of_row.numel())  # > any token index
    counts = torch.tensor([bounds[e + 1] - bounds[e] for e in range(num_experts)], device=dev)
    keys = torch.repeat_interleave(torch.arange(num_experts, device=dev) * span, counts)
    keys += token_of_row
    ends = torch.tensor([(t0, t1) for t0, t1, _ in segments], device=dev)  # [S, 2]
    base = torch.arange(num_experts, device=dev).view(-1, 1, 1) * span  # [E, 1, 1]
    where = torch.searchsorted(keys, (base + ends).reshape(-1)).view(num_experts, -1, 2)
    for e, per_seg in enumerate(where.tolist()):
        for (r0, r1), (_, _, lora) in zip(per_seg, segments, strict=True):
            if r1 > r0:
                runs[e].append((r0, r1, lora))
    return runs
