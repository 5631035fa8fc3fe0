"""How LoRA modules map onto the model's fused projections.

The model runs q/k/v as one matmul and gate/up as one, so LoRA is applied per *group*: the
modules of a group share their input (d_in) and their outputs are concatenated in the order
given here. Each adapter's modules are packed side by side along the rank axis, so one
shrink matmul `x @ A[:r].T` serves the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.config import ModelConfig

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
GROUP_NAMES: tuple[str, ...] = tuple(GROUPS)
MODULE_TO_GROUP: dict[str, str] = {m: g for g, mods in GROUPS.items() for m in mods}

# Shrink weights are stored transposed, in tiles of this many rank columns (the C kernel's
# register tile, lora/sgmv_cpu.c), and packed ranks are padded to whole 8-float half-vectors.
# Expand weights: each module's B.T [r, d_out] is stored in strips as wide as the tiles.
# A slot pool picks its tile width (`tile_width`): this default, or 16 where the C kernel is
# built for AVX2 (its 16-column register tiles then read each tile as one stream).
RANK_TILE = 64
B_STRIP = RANK_TILE
TILE_WIDTHS = (16, 64)
RANK_ALIGN = 8

def b_strips(r: int, d_out: int, width: int = B_STRIP) -> tuple[tuple[int, int, int], ...]:
    """(first column, width, offset) of each strip of a module's B.T [r, d_out] block: strip k
    is B.T[:, c0:c0 + w] as a row-major [r, w] block at `offset` floats into the block, so the
    kernel's register tiles each read one contiguous stream. Only the last strip can be
    narrower than `width`."""
    return tuple((c0, min(width, d_out - c0), c0 * r) for c0 in range(0, d_out, width))


# One expand part of a packed group (one module): rank rows [o0, o1) of t = x @ A.T produce
# output columns [c0, c1) of the fused output y, through the [o1 - o0, c1 - c0] block of the
# slot's B that starts at offset boff (adapters/slot_pool.py).
Part = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class GroupLayout:
    """Shapes of one module group for a given model."""

    name: str
    modules: tuple[str, ...]
    d_in: int
    d_outs: tuple[int, ...]  # per module, in `modules` order
    col_offsets: tuple[int, ...]  # where each module's output starts in the fused output

    @property
    def d_out(self) -> int:
        return sum(self.d_outs)

    def rank_capacity(self, max_lora_rank: int) -> int:
        """R_g: rank columns a slot reserves for this group (padded to whole vectors)."""
        return padded_rank(len(self.modules) * max_lora_rank)


def padded_rank(r: int) -> int:
    """Rank columns a packed rank r occupies: r rounded up to whole vectors (zeros past r)."""
    return -(-r // RANK_ALIGN) * RANK_ALIGN


def a_tiles(r: int, d_in: int, width: int = RANK_TILE) -> tuple[tuple[int, int, int], ...]:
    """(first rank column, width, offset) of each tile of a slot's shrink weights for packed
    rank r: tile k holds A.T[:, c0:c0 + w] as a row-major [d_in, w] block at `offset` floats
    into the slot, so the kernel streams every tile contiguously."""
    rp = padded_rank(r)
    return tuple((c0, min(width, rp - c0), c0 * d_in) for c0 in range(0, rp, width))


def group_layouts(cfg: ModelConfig) -> dict[str, GroupLayout]:
    """Every group; those the model lacks (the MLP of a mixture of experts without a shared
    expert) are zero wide, so their slot buffers take no memory and no adapter targets them."""
    out = {}
    for name, mods in GROUPS.items():
        shapes = [cfg.module_shape(m) for m in mods]
        if not cfg.dense_mlp and name in ("gate_up", "down"):
            shapes = [(0, 0)] * len(mods)
        d_ins = {d_in for _, d_in in shapes}
        if len(d_ins) != 1:  # cannot happen for the Llama family; guards a future model
            raise ValueError(f"modules of group {name} have different inputs: {d_ins}")
        d_outs = tuple(d_out for d_out, _ in shapes)
        offsets = tuple(sum(d_outs[:k]) for k in range(len(d_outs)))
        out[name] = GroupLayout(name, mods, d_ins.pop(), d_outs, offsets)
    return out
