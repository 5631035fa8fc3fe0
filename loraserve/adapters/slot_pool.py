"""Preallocated compute-memory slots holding packed LoRA weights, one adapter per slot.

Layout, per layer and module group g (see lora/layout.py):
    A[layer][g]: [S, R_g, d_in]     shrink weights, rank-major
    B[layer][g]: [S, R_g, d_out_g]  expand weights stored transposed (B_m.T), already scaled
with R_g = len(modules of g) * max_lora_rank. An adapter's modules of a group are packed along
the rank axis: module m takes rank rows [off_m, off_m + r_m) of A, and the block
B[s, off_m:off_m + r_m, col_m:col_m + d_out_m] of B (block diagonal), so that
    y_g += (x @ A[s, :r].T) @ B[s, :r]
adds exactly every module's delta. B is kept rank-major because B[s, :r] and every module
block then have contiguous rows, which small-M BLAS calls read fastest on this CPU.

Ranks differing across layers (PEFT rank_pattern / layers_to_transform): module m gets
r_m = its max rank over layers, in every layer; rows beyond a layer's own rank stay zero.
So offsets and the packed rank are per (slot, group), not per layer, and the batch metadata
needs no per-layer data; the cost is a few zero rows on the layers with smaller ranks.

Memory: nbytes = S * L * max_lora_rank * itemsize * sum_g n_g * (d_in_g + d_out_g)
(n_g = modules in group g); for SmolLM2-135M at max rank 64, fp32: 111 MiB per slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loraserve.config import ModelConfig
from loraserve.lora.layout import GROUP_NAMES, MODULE_TO_GROUP, GroupLayout, Part, group_layouts

if TYPE_CHECKING:
    from loraserve.adapters.format import LoraAdapterWeights

# Expand policy "auto": splitting a group's expand into per-module matmuls skips the zero
# blocks of B but costs one more BLAS call per module. Measured on 2 AVX-512 cores (decode,
# 4 tokens/segment): fused wins at rank 8, split at rank >= 16 for gate_up; a small-M call
# costs about as much as streaming this many weight bytes.
SPLIT_MIN_SAVED_BYTES = 128 * 1024
# Above ~12 tokens a segment's matmuls turn compute-bound: the zero blocks then waste FLOPs
# in proportion to the token count, so they count for that much more.
SPLIT_COMPUTE_BOUND_TOKENS = 12


class LoraSlotPool:
    """num_slots adapter slots in compute memory. Invariant: every weight outside the packed
    blocks of the slot's current adapter is exactly zero (a reused slot is fully overwritten),
    and a cleared slot is all zero with rank 0 in every group."""

    def __init__(
        self,
        model_config: ModelConfig,
        num_slots: int,
        max_lora_rank: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        expand: str = "auto",  # "auto" | "fused" | "split": how parts() splits B (see above)
    ) -> None:
        if num_slots < 1 or max_lora_rank < 1:
            raise ValueError("num_slots and max_lora_rank must be >= 1")
        self.model_config = model_config
        self.num_slots = num_slots
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.layouts: dict[str, GroupLayout] = group_layouts(model_config)
        self.A: list[dict[str, torch.Tensor]] = []
        self.B: list[dict[str, torch.Tensor]] = []
        for _ in range(model_config.num_hidden_layers):
            a, b = {}, {}
            for g, lay in self.layouts.items():
                cap = lay.rank_capacity(max_lora_rank)
                a[g] = torch.zeros(num_slots, cap, lay.d_in, dtype=dtype, device=device)
                b[g] = torch.zeros(num_slots, cap, lay.d_out, dtype=dtype, device=device)
            self.A.append(a)
            self.B.append(b)
        self._ranks: list[dict[str, int]] = [
            dict.fromkeys(GROUP_NAMES, 0) for _ in range(num_slots)
        ]
        # per slot and group: (fused parts, split parts, bytes the split skips)
        self._parts: list[dict[str, tuple]] = [
            {g: ((), (), 0) for g in GROUP_NAMES} for _ in range(num_slots)
        ]
        self.set_expand(expand)

    @property
    def nbytes(self) -> int:
        return sum(
            t.nbytes for per_layer in (self.A, self.B) for d in per_layer for t in d.values()
        )

    def rank(self, slot: int, group: str) -> int:
        """Packed rank of `group` in `slot` (0: the adapter targets none of its modules)."""
        return self._ranks[slot][group]

    def parts(self, slot: int, group: str, num_tokens: int = 1) -> tuple[Part, ...]:
        """Expand parts (o0, o1, c0, c1) covering the slot's nonzero blocks of B, for a
        segment of num_tokens tokens: one fused block-diagonal matmul, or one per module."""
        fused, split, saved = self._parts[slot][group]
        if self.expand == "fused" or len(split) <= 1 and saved == 0:
            return fused
        if self.expand == "split" or len(split) == 1:  # same call count, fewer bytes
            return split
        weight = max(1.0, num_tokens / SPLIT_COMPUTE_BOUND_TOKENS)
        return split if saved * weight >= SPLIT_MIN_SAVED_BYTES * (len(split) - 1) else fused

    def set_expand(self, expand: str) -> None:
        """How parts() splits each group's expand, for every slot; "auto" except to measure."""
        if expand not in ("auto", "fused", "split"):
            raise ValueError(f"unknown expand policy {expand!r}")
        self.expand = expand

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        self._zero(slot)
        self._ranks[slot] = dict.fromkeys(GROUP_NAMES, 0)
        self._parts[slot] = {g: ((), (), 0) for g in GROUP_NAMES}

    def write(self, slot: int, weights: LoraAdapterWeights) -> None:
        """Pack `weights` into `slot`, replacing whatever was there. Validates everything
        before touching the slot, so a rejected adapter leaves the slot unchanged."""
        self._check_slot(slot)
        mod_ranks = self._validate(weights)
        offsets: dict[str, int] = {}
        ranks = dict.fromkeys(GROUP_NAMES, 0)
        for g, lay in self.layouts.items():
            for m in lay.modules:
                if mod_ranks.get(m, 0) > 0:
                    offsets[m] = ranks[g]
                    ranks[g] += mod_ranks[m]
        self._zero(slot)  # modules the new adapter does not target must read as zero
        for layer, mods in enumerate(weights.layers):
            for m, mw in mods.items():
                r = mw.A.shape[0]
                if r == 0:
                    continue
                g = MODULE_TO_GROUP[m]
                lay = self.layouts[g]
                k = lay.modules.index(m)
                off, c0, d_out = offsets[m], lay.col_offsets[k], lay.d_outs[k]
                self.A[layer][g][slot, off : off + r].copy_(mw.A)
                self.B[layer][g][slot, off : off + r, c0 : c0 + d_out].copy_(mw.B.T)
        self._ranks[slot] = ranks
        self._parts[slot] = {g: self._plan_parts(g, offsets, mod_ranks) for g in GROUP_NAMES}

    # -- internals ---------------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")

    def _zero(self, slot: int) -> None:
        for per_layer in (self.A, self.B):
            for d in per_layer:
                for t in d.values():
                    t[slot].zero_()

    def _validate(self, weights: LoraAdapterWeights) -> dict[str, int]:
        """Check shapes and ranks; return each module's rank (max over layers)."""
        n_layers = self.model_config.num_hidden_layers
        if len(weights.layers) != n_layers:
            raise ValueError(f"adapter has {len(weights.layers)} layers, model has {n_layers}")
        mod_ranks: dict[str, int] = {}
        for layer, mods in enumerate(weights.layers):
            for m, mw in mods.items():
                if m not in MODULE_TO_GROUP:
                    raise ValueError(f"layer {layer}: unsupported LoRA module {m!r}")
                d_out, d_in = self.model_config.module_shape(m)
                r = mw.A.shape[0]
                if r > self.max_lora_rank:
                    raise ValueError(
                        f"layer {layer} {m}: rank {r} exceeds max_lora_rank {self.max_lora_rank}"
                    )
                if tuple(mw.A.shape) != (r, d_in) or tuple(mw.B.shape) != (d_out, r):
                    raise ValueError(
                        f"layer {layer} {m}: A {tuple(mw.A.shape)} / B {tuple(mw.B.shape)} do not "
                        f"match ({r}, {d_in}) / ({d_out}, {r})"
                    )
                mod_ranks[m] = max(mod_ranks.get(m, 0), r)
        return mod_ranks

    def _plan_parts(
        self, g: str, offsets: dict[str, int], mod_ranks: dict[str, int]
    ) -> tuple[tuple[Part, ...], tuple[Part, ...], int]:
        """(fused parts, split parts, weight bytes the split skips) of one group."""
        lay = self.layouts[g]
        split = tuple(
            (offsets[m], offsets[m] + mod_ranks[m], c0, c0 + d)
            for m, c0, d in zip(lay.modules, lay.col_offsets, lay.d_outs, strict=True)
            if m in offsets
        )
        if not split:
            return (), (), 0
        r = split[-1][1]
        used = sum((o1 - o0) * (c1 - c0) for o0, o1, c0, c1 in split)
        return ((0, r, 0, lay.d_out),), split, (r * lay.d_out - used) * self.A[0][g].element_size()
