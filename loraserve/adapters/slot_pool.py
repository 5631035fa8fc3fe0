"""Preallocated compute-memory slots holding packed LoRA weights, one adapter per slot.

Layout, per layer and module group g (see lora/layout.py):
    A[layer][g]: [S, R_g * d_in]                  shrink weights, transposed, in rank tiles
    B[layer][g]: [S, max_lora_rank * d_out_g]     expand weights, one dense block per module
with R_g = len(modules of g) * max_lora_rank (padded to 8). An adapter's modules of a group
are packed side by side along the rank axis: module m takes rank columns [o_m, o_m + r_m) of
A.T ([d_in, r], r = the packed rank padded to 8, zero past the modules), which is stored as
row-major [d_in, <= W] tiles one after another (layout.a_tiles), and a contiguous block of B
at offset boff_m holding B_m.T (already scaled), [r_m, d_out_m], as row-major [r_m, <= W]
column strips one after another (layout.b_strips), W = the pool's `tile_width` (64, or 16
for the C kernel's AVX2 build). So for every module
    y_g[:, cols_m] += (x @ A.T)[:, o_m:o_m + r_m] @ B_block_m
adds exactly its delta, and the kernel reads only the adapter's own weights, each register
tile's weights in one contiguous stream: A is transposed so the shrink is a broadcast-FMA GEMM
with no horizontal sums, and B is in strips so a 64-column tile does not stride across rows
(lora/sgmv_cpu.c: row-major blocks would make each tile read 64 columns out of every row, and
a block-diagonal dense B would read short strided runs and take n_g times the memory;
`benchmarks/kernels/kernel_ab.py lora` times the op before and after a layout change).

Ranks differing across layers (PEFT rank_pattern / layers_to_transform): module m gets
r_m = its max rank over layers, in every layer; rows beyond a layer's own rank stay zero.
So offsets and the packed rank are per (slot, group), not per layer, and the batch metadata
needs no per-layer data; the cost is a few zero rows on the layers with smaller ranks.

Memory: nbytes = S * L * itemsize * sum_g (R_g * d_in_g + max_lora_rank * d_out_g);
for SmolLM2-135M at max rank 64, fp32: 75 MiB per slot. Plus, per slot whose adapter has them,
its parts beyond B @ A (`extras`, adapters/slot_extras.py): DoRA scales, lora_bias, its
vocabulary parts (a full lm_head or embedding copy is counted here too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loraserve.adapters.slot_copies import StreamSlotCopies
from loraserve.adapters.slot_extras import pack_extras
from loraserve.config import ModelConfig
from loraserve.lora.extras import AdapterExtras
from loraserve.lora.layout import (
    GROUP_NAMES,
    MODULE_TO_GROUP,
    RANK_TILE,
    TILE_WIDTHS,
    GroupLayout,
    Part,
    a_tiles,
    group_layouts,
    padded_rank,
)
from loraserve.ops.hugepages import zeros_huge

if TYPE_CHECKING:
    from loraserve.adapters.format import LoraAdapterWeights

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
        copies: StreamSlotCopies | None = None,
        tile_width: int = RANK_TILE,
    ) -> None:
        if num_slots < 1 or max_lora_rank < 1:
            raise ValueError("num_slots and max_lora_rank must be >= 1")
        if tile_width not in TILE_WIDTHS:
            raise ValueError(f"tile_width must be one of {TILE_WIDTHS}, not {tile_width}")
        self.tile_width = tile_width  # of A tiles and B strips (layout.py)
        self.model_config = model_config
        self.num_slots = num_slots
        # times `grow` replaced A and B: addresses taken before another grow point at freed
        # memory (lora/backends/cpu_kernel.py keys its table of them on it)
        self.generation = 0
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.layouts: dict[str, GroupLayout] = group_layouts(model_config)
        self.A: list[dict[str, torch.Tensor]] = []
        self.B: list[dict[str, torch.Tensor]] = []
        for _ in range(model_config.num_hidden_layers):
            a, b = {}, {}
            for g, lay in self.layouts.items():
                cap = lay.rank_capacity(max_lora_rank)
                # 2 MB pages on CPU: a decode step reads every slot's weights
                a[g] = zeros_huge(num_slots, cap * lay.d_in, dtype=dtype, device=device)
                b[g] = zeros_huge(num_slots, max_lora_rank * lay.d_out, dtype=dtype,
                                  device=device)
            self.A.append(a)
            self.B.append(b)
        self._ranks: list[dict[str, int]] = [
            dict.fromkeys(GROUP_NAMES, 0) for _ in range(num_slots)
        ]
        self._parts: list[dict[str, tuple[Part, ...]]] = [
            dict.fromkeys(GROUP_NAMES, ()) for _ in range(num_slots)
        ]
        # the fingerprint of the weights each slot holds (None: cleared), so the store's
        # record of who owns a slot can be checked against what the slot really holds
        self.content: list[str | None] = [None] * num_slots
        # per slot: its adapter's parts beyond B @ A (None: plain LoRA, or cleared)
        self.extras: list[AdapterExtras | None] = [None] * num_slots
        # GPU: slots are packed on the host and copied on a side stream (slot_copies.py)
        self.copies = copies if copies is not None or self.device.type != "cuda" else (
            StreamSlotCopies(self.device))

    @property
    def nbytes(self) -> int:
        return sum(
            t.nbytes for per_layer in (self.A, self.B) for d in per_layer for t in d.values()
        ) + sum(e.nbytes for e in self.extras if e is not None)

    def rank(self, slot: int, group: str) -> int:
        """Packed rank of `group` in `slot` (0: the adapter targets none of its modules)."""
        return self._ranks[slot][group]

    def a_tiles(self, slot: int, group: str) -> tuple[tuple[int, int, int], ...]:
        """(first rank column, width, offset) of each [d_in, width] tile of the slot's A.T."""
        return a_tiles(self._ranks[slot][group], self.layouts[group].d_in, self.tile_width)

    def parts(self, slot: int, group: str) -> tuple[Part, ...]:
        """One expand part (o0, o1, c0, c1, boff) per module of `group` the slot's adapter
        targets: rank rows [o0, o1) of t = x @ A.T produce output columns [c0, c1) through
        the [o1 - o0, c1 - c0] block of B[slot] at offset boff."""
        return self._parts[slot][group]

    def grow(self, num_slots: int) -> None:
        """Room for `num_slots` adapters, keeping every slot's contents (new slots are empty).
        The LoRA backends read `A`/`B` afresh each call, so they see the new tensors (what keeps
        their addresses, the C decode loop's table and the decode graphs, takes them again
        after a grow); the store grows the pool only between steps."""
        if num_slots <= self.num_slots:
            return
        if self.copies is not None:
            self.copies.drain()  # copies in flight target the tensors replaced here
        for per_layer in (self.A, self.B):
            for d in per_layer:
                for g, t in d.items():
                    bigger = zeros_huge(num_slots, t.shape[1], dtype=t.dtype, device=t.device)
                    bigger[: self.num_slots] = t
                    d[g] = bigger
        extra = num_slots - self.num_slots
        self._ranks += [dict.fromkeys(GROUP_NAMES, 0) for _ in range(extra)]
        self._parts += [dict.fromkeys(GROUP_NAMES, ()) for _ in range(extra)]
        self.content += [None] * extra
        self.extras += [None] * extra
        self.num_slots = num_slots
        self.generation += 1

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        self.before_step([slot])  # after any copy into it
        self._zero(slot)
        self._ranks[slot] = dict.fromkeys(GROUP_NAMES, 0)
        self._parts[slot] = dict.fromkeys(GROUP_NAMES, ())
        self.content[slot] = None
        self.extras[slot] = None

    def write(self, slot: int, weights: LoraAdapterWeights) -> None:
        """Pack `weights` into `slot`, replacing whatever was there. Validates everything
        before touching the slot, so a rejected adapter leaves the slot unchanged."""
        self._check_slot(slot)
        mod_ranks = self._validate(weights)
        extras = pack_extras(weights, self.layouts, self.device)
        parts = {g: self._plan_parts(g, mod_ranks) for g in GROUP_NAMES}
        where = {m: part for g in GROUP_NAMES for m, part in parts[g].items()}
        ranks = {g: max((p[1] for p in parts[g].values()), default=0) for g in GROUP_NAMES}
        # rows and blocks the new adapter does not fill must read as zero: the slot's own rows
        # zeroed on CPU, zeroed staging rows copied over all of it on a GPU
        if self.copies is None:
            self._zero(slot)
            rows = [{g: (self.A[layer][g][slot], self.B[layer][g][slot]) for g in GROUP_NAMES}
                    for layer in range(len(self.A))]
        else:
            rows = [{g: (self.copies.staging(self.A[layer][g].shape[1], self.dtype),
                         self.copies.staging(self.B[layer][g].shape[1], self.dtype))
                     for g in GROUP_NAMES} for layer in range(len(self.A))]
        for layer, mods in enumerate(weights.layers):
            dev = rows[layer][GROUP_NAMES[0]][0].device
            a_t = {g: torch.zeros(self.layouts[g].d_in, padded_rank(r), dtype=self.dtype,
                                  device=dev)
                   for g, r in ranks.items() if r}  # the group's packed A.T, [d_in, r]
            for m, mw in mods.items():
                r = mw.A.shape[0]
                if r == 0:
                    continue
                g = MODULE_TO_GROUP[m]
                o0, o1, c0, c1, boff = where[m]
                a_t[g][:, o0 : o0 + r].copy_(mw.A.T)
                block = rows[layer][g][1][boff : boff + (o1 - o0) * (c1 - c0)]
                write_b_strips(block, mw.B.T, o1 - o0, self.tile_width)
            for g, full in a_t.items():
                d_in = self.layouts[g].d_in
                for t0, w, off in a_tiles(ranks[g], d_in, self.tile_width):
                    rows[layer][g][0][off : off + d_in * w].view(d_in, w).copy_(
                        full[:, t0 : t0 + w])
        if self.copies is not None:
            self.copies.write(slot, [(dev_row, host_row) for layer, per_g in enumerate(rows)
                                     for g, pair in per_g.items()
                                     for dev_row, host_row in zip(
                                         (self.A[layer][g][slot], self.B[layer][g][slot]),
                                         pair, strict=True)])
        self._ranks[slot] = ranks
        self._parts[slot] = {g: tuple(parts[g].values()) for g in GROUP_NAMES}
        self.content[slot] = weights.fingerprint
        self.extras[slot] = extras

    def release(self, slot: int) -> None:
        """The slot's adapter left it: free its parts beyond B @ A now (a full lm_head copy
        may be large); the packed rows stay until the next write zeroes them."""
        self._check_slot(slot)
        self.extras[slot] = None

    def before_step(self, slots) -> None:
        """A step is about to read `slots`: order it after their copies (GPU; else nothing)."""
        if self.copies is not None:
            self.copies.before_step(slots)

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

    def _plan_parts(self, g: str, mod_ranks: dict[str, int]) -> dict[str, Part]:
        """Where each targeted module of group g goes: its rank rows in A and block in B."""
        lay = self.layouts[g]
        parts, row, boff = {}, 0, 0
        for m, c0, d in zip(lay.modules, lay.col_offsets, lay.d_outs, strict=True):
            r = mod_ranks.get(m, 0)
            if r > 0:
                parts[m] = (row, row + r, c0, c0 + d, boff)
                row, boff = row + r, boff + r * d
        return parts


def write_b_strips(block: torch.Tensor, bt: torch.Tensor, rows: int, width: int) -> None:
    """Copy a module's B.T [r, d_out] into its expand block (`rows` x d_out floats) cut into
    strips as layout.b_strips lays them out; rows past r are left as they are (zero). The
    full-width strips go in one strided copy: an update of a large adapter is thousands of
    strips, written between two engine steps."""
    r, d_out = bt.shape
    full = d_out // width
    if full:
        # strip k: block[k*rows*width:][:rows*width] as [rows, width] = bt[:, k*width:][:width]
        block[: full * rows * width].view(full, rows, width)[:, :r].copy_(
            bt[:, : full * width].unflatten(1, (full, width)).transpose(0, 1))
    if d_out % width:
        c0 = full * width
        block[c0 * rows : c0 * rows + rows * (d_out - c0)].view(rows, d_out - c0)[:r].copy_(
            bt[:, c0:])
