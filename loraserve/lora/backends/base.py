"""The LoRA op's interface: every backend computes exactly this, and is tested against
lora/reference.py through it.

Semantics. The step's tokens form a flat batch; `plan(seq_slots)` says which slot each
sequence uses (None/-1: the base model), in batch order, and tokens of one slot are merged
into contiguous segments. Then, for one layer and module group g, `apply(plan, layer, g, x, y)`
does, in place on y, for every token t of a segment of slot s and every module m of g that
slot s's adapter targets in that layer:

    y[t, cols_m] += (x[t] @ A_m.T) @ B_m.T          (B already carries the scale)

Base-model tokens, and groups the slot's adapter does not target, are left bit-for-bit
unchanged. Adapters of different ranks share a batch, and each segment costs its slot's
packed rank, never max_lora_rank (the slot layout is lora/layout.py). Segments may be empty.
A batch with no adapter token has no plan at all (`plan` returns None), so a base-only step
pays nothing for LoRA.

What an adapter has beyond B @ A (DoRA's column scale, lora_bias, its vocabulary parts:
lora/extras.py) is applied by `LoraStep`, after the backend's projection, the same for every
backend; `plan` lists the segments of slots that have any.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from loraserve.lora.batch import LoraBatch, SlotWeights
from loraserve.lora.expert_lora import ExpertLora, expert_runs
from loraserve.lora.extras import (
    ExtraSegment,
    apply_epilogues,
    embed_with_extras,
    head_with_extras,
)
from loraserve.lora.layout import GROUP_NAMES
from loraserve.ops.native_lora import NativeLoraStep


@dataclass(frozen=True)
class LoraPlan:
    """One step's metadata: the segments, and per group with work the backend's own data."""

    batch: LoraBatch
    groups: dict[str, Any]
    extras: tuple[ExtraSegment, ...] = ()  # segments of slots with parts beyond B @ A


class LoraBackend(ABC):
    name: ClassVar[str]

    def __init__(self, weights: SlotWeights) -> None:
        self.weights = weights

    def plan(self, seq_slots: Sequence[tuple[int | None, int]]) -> LoraPlan | None:
        """Built once per step, reused by every layer and group; None for a base-only batch."""
        batch = LoraBatch.build(seq_slots, self.weights)
        if batch.is_empty:
            return None
        groups = {}
        for g in GROUP_NAMES:
            segs = batch.group_segments(g)
            if segs:  # no adapter here targets this group: no work at all
                groups[g] = self.plan_group(batch, g, segs)
        extras = tuple((s, a, b, ext) for s, a, b in batch.segments
                       if (ext := self.weights.extras[s]) is not None)
        return LoraPlan(batch, groups, extras)

    def has_extras(self, seq_slots: Sequence[tuple[int | None, int]]) -> bool:
        """Whether a slot of this step has parts beyond B @ A (captured graphs lack them)."""
        return any(s is not None and s >= 0 and n and self.weights.extras[s] is not None
                   for s, n in seq_slots)

    def project(self, plan: LoraPlan, layer: int, group: str, x: torch.Tensor,
                linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`linear(x)` with the group's LoRA deltas added: the projection, then `apply`. A
        backend may fuse the two (cpu_kernel.py does), with the same results."""
        y = linear(x)
        self.apply(plan, layer, group, x, y)
        return y

    def native_step(self, plan: LoraPlan) -> NativeLoraStep | None:
        """The plan's op as a loop in C calls it (ops/native_lora.py); None: this backend
        has no such view, or the plan needs more than B @ A (extras)."""
        return None

    def step(self, plan: LoraPlan | None) -> LoraStep | None:
        """The model's LoRA hook for a step with this plan (None: a base-only step)."""
        return None if plan is None else LoraStep(self, plan)

    def apply(self, plan: LoraPlan, layer: int, group: str, x: torch.Tensor,
              y: torch.Tensor) -> None:
        """x: [T, d_in] the group's input; y: [T, d_out_g] its fused output, updated in place
        (rows contiguous)."""
        data = plan.groups.get(group)
        if data is not None:
            self.apply_group(data, self.weights.A[layer][group], self.weights.B[layer][group],
                             x, y)

    @abstractmethod
    def plan_group(self, batch: LoraBatch, group: str,
                   segments: list[tuple[int, int, int, int]]) -> Any:
        """This backend's data for one group; `segments`: (slot, start, end, packed rank)
        of the segments that touch it."""

    @abstractmethod
    def apply_group(self, data: Any, group_A: torch.Tensor, group_B: torch.Tensor,
                    x: torch.Tensor, y: torch.Tensor) -> None:
        """The op on one layer's weights of the group: group_A [S, R_g * d_in], group_B
        [S, max_rank * d_out_g] (the slot pool's tensors)."""


class LoraStep:
    """The model's LoRA hook (model/llama.LoraHook) for one step: the backend and its plan."""

    def __init__(self, backend: LoraBackend, plan: LoraPlan) -> None:
        self.backend, self.plan = backend, plan

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Adds the B @ A deltas only (no column epilogue: that needs the projection)."""
        self.backend.apply(self.plan, layer, group, x, y)

    def project(self, layer: int, group: str, x: torch.Tensor,
                linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        y = self.backend.project(self.plan, layer, group, x, linear)
        if self.plan.extras:
            apply_epilogues(self.plan.extras, layer, group, y, linear)
        return y

    def expert_runs(self, layer: int, token_of_row: torch.Tensor, bounds: Sequence[int]
                    ) -> list[list[tuple[int, int, ExpertLora]]] | None:
        """Where each adapter's expert LoRA of `layer` applies in its expert-sorted rows
        (model/moe.py); None when no adapter of the step has any there."""
        segs = [(a, b, ext.experts[layer]) for _, a, b, ext in self.plan.extras
                if ext.experts and ext.experts[layer] is not None and b > a]
        return expert_runs(segs, token_of_row, bounds) if segs else None

    def native(self) -> NativeLoraStep | None:
        """The step's op for the C decode loop (model/native_decode.c), or None."""
        return self.backend.native_step(self.plan)

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The embedding lookup of ids [T] in table [V, d], with adapters' vocabulary parts."""
        return embed_with_extras(self.plan.extras, ids, table)

    def head(self, rows: torch.Tensor, x: torch.Tensor,
             lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """lm_head(x) for the hidden states x [B, d] of token rows `rows` [B], with adapters'
        vocabulary parts on their rows."""
        return head_with_extras(self.plan.extras, rows, x, lm_head)
