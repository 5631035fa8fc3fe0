"""One step's LoRA op as a loop in C calls it (model/native_decode.c, `lora_step_t`): the
kernel's address, its scratch width, a table of every layer's adapter weight addresses and,
per module group, the step's segments and parts. The LoRA backend fills it (lora/backends/
cpu_kernel.py); the model passes it on without knowing adapters. Here, below both, so that
the two sides share one layout.

The descriptor is one int64 tensor, read by the C loop as the struct below; the addresses in
it stay valid while the tensors in `keep` live (the caller holds the descriptor's owner for
the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The projections' groups in the order of the C struct (and of the layer's projections).
NATIVE_GROUPS = ("qkv", "o", "gate_up", "down")
HEADER_FIELDS = ("fn", "tile", "ldt", "n_layers", "tables")
GROUP_FIELDS = ("segs", "nsegs", "parts", "nparts", "a_slot", "b_slot", "d_in")


@dataclass(frozen=True)
class NativeLoraStep:
    """`desc` int64 [len(HEADER_FIELDS) + 4 * len(GROUP_FIELDS)]; `ldt` the floats a row of
    the kernel's shrink scratch takes (the caller allocates B rows of it); `keep` the tensors
    whose addresses `desc` holds."""

    desc: torch.Tensor
    ldt: int
    keep: tuple[torch.Tensor, ...]


def weight_table(A: list[dict[str, torch.Tensor]], B: list[dict[str, torch.Tensor]]
                 ) -> torch.Tensor | None:
    """int64 [layers, 4, 2]: each layer's A and B pool addresses per group, in NATIVE_GROUPS
    order; None where a layer lacks a group or a group's slot strides differ between layers
    (the C loop takes one stride per group)."""
    rows = []
    for a, b in zip(A, B, strict=True):
        if any(g not in a or g not in b for g in NATIVE_GROUPS):
            return None
        rows.append([[a[g].data_ptr(), b[g].data_ptr()] for g in NATIVE_GROUPS])
    for g in NATIVE_GROUPS:
        if len({(a[g].stride(0), b[g].stride(0)) for a, b in zip(A, B, strict=True)}) != 1:
            return None
    return torch.tensor(rows, dtype=torch.int64)


def pack_step(fn: int, tile: int, ldt: int, tables: torch.Tensor,
              groups: dict[str, tuple[torch.Tensor, torch.Tensor, int, int, int]]
              ) -> NativeLoraStep:
    """groups: name -> (segs int64 [n, 4], parts int64 [m, 6], A slot stride, B slot stride,
    d_in) of the groups with work this step; the others get no segments."""
    desc = [fn, tile, ldt, tables.shape[0], tables.data_ptr()]
    keep = [tables]
    for g in NATIVE_GROUPS:
        if g in groups:
            segs, parts, a_slot, b_slot, d_in = groups[g]
            desc += [segs.data_ptr(), segs.shape[0], parts.data_ptr(), parts.shape[0],
                     a_slot, b_slot, d_in]
            keep += [segs, parts]
        else:
            desc += [0] * len(GROUP_FIELDS)
    return NativeLoraStep(torch.tensor(desc, dtype=torch.int64), ldt, tuple(keep))
