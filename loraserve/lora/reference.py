"""The LoRA op's plain per-token reference: readable, slow, straight from the adapters' own
weights (not the slot pool). Every backend is tested against it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from loraserve.lora.layout import GroupLayout

if TYPE_CHECKING:
    from loraserve.adapters.format import LoraModuleWeights


def lora_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    token_modules: Sequence[Mapping[str, LoraModuleWeights] | None],
    layout: GroupLayout,
) -> torch.Tensor:
    """Readable reference, straight from the adapters' own weights (not the pool):
    for each token t and module m of the group, y[t, cols_m] += (x[t] @ A_m.T) @ B_m.T.

    x: [T, d_in]; y: [T, d_out_g], updated in place and returned
    token_modules[t]: that token's adapter's modules in this layer (None = base model)
    """
    if len(token_modules) != x.shape[0]:
        raise ValueError(f"{len(token_modules)} token entries for {x.shape[0]} tokens")
    for t, mods in enumerate(token_modules):
        if not mods:
            continue
        for m, c0, d in zip(layout.modules, layout.col_offsets, layout.d_outs, strict=True):
            mw = mods.get(m)
            if mw is not None:
                y[t, c0 : c0 + d] += (x[t] @ mw.A.T) @ mw.B.T  # B already carries the scale
    return y
