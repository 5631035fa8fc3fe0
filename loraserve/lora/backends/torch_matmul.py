"""The `torch` LoRA backend: one shrink and one expand matmul per segment and module, on views
of the slot pool (no weight copies), sized by the segment's packed rank (Punica's SGMV
written as matmuls). Runs wherever torch does; on CPU the C kernel is faster (it reads
each adapter's packed tiles in one stream instead of two matmul calls per segment and module;
benchmarks/kernels/lora_op_micro.py compares them). Gathering per-token weights for bmm would
be slower still: it copies weights every call.
"""

from __future__ import annotations

import torch

from loraserve.lora.backends.base import LoraBackend
from loraserve.lora.batch import LoraBatch, SlotWeights
from loraserve.lora.layout import Part, padded_rank
from loraserve.ops.gemm import onednn_enabled, onednn_linear

# One expand part as indices: (t_idx, y_idx, b_idx, block shape); t_idx/y_idx None = the whole
# tensor; group_B[b_idx].view(shape) is the module's block of B.
PartIndex = tuple[tuple | None, tuple | None, tuple, tuple[int, int]]
# One tile of a slot's shrink weights: group_A[idx].view(shape) is a [d_in, w] block of A.T;
# the tiles of a segment, in order, hold its rank columns [0, padded rank).
TileIndex = tuple[tuple, tuple[int, int]]
# One segment of one group: (token slice, A.T tiles, expand parts).
SegmentPlan = tuple[slice, tuple[TileIndex, ...], tuple[PartIndex, ...]]


class TorchLoraBackend(LoraBackend):
    name = "torch"

    def __init__(self, weights: SlotWeights) -> None:
        super().__init__(weights)
        # oneDNN's GEMM beats MKL's sgemm on long segments on AMD hosts, where MKL takes a
        # slow path (benchmarks/kernels/lora_op_micro.py, torch-onednn against torch-segments)
        self.onednn = onednn_enabled() and weights.device.type == "cpu"  # oneDNN: CPU only

    def plan_group(self, batch: LoraBatch, group: str,
                   segments: list[tuple[int, int, int, int]]) -> tuple[SegmentPlan, ...]:
        w = self.weights
        d_in, d_out = w.layouts[group].d_in, w.layouts[group].d_out
        plan = []
        for s, a, b, r in segments:
            tiles = tuple(((s, slice(off, off + d_in * width)), (d_in, width))
                          for _, width, off in w.a_tiles(s, group))
            plan.append((slice(a, b), tiles, _part_indices(s, r, d_out, w.parts(s, group))))
        return tuple(plan)

    def apply_group(self, plan: tuple[SegmentPlan, ...], group_A: torch.Tensor,
                    group_B: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        for xs, tiles, parts in plan:
            xseg = x[xs]
            # t: [n, padded rank] = x[a:b] @ A.T, one matmul per [d_in, <= 64] tile of A.T
            # (.to: bf16-stored weights are widened per call on this path)
            ts = [onednn_linear(xseg, group_A[idx].view(shape).to(x.dtype).t()) if self.onednn
                  else torch.mm(xseg, group_A[idx].view(shape).to(x.dtype))
                  for idx, shape in tiles]
            t = ts[0] if len(ts) == 1 else torch.cat(ts, dim=1)
            ys = y[xs]  # ys: [n, d_out_g], a view: in-place updates write through
            for t_idx, y_idx, b_idx, shape in parts:
                # ys[:, c0:c1] += t[:, o0:o1] @ (the module's [o1 - o0, c1 - c0] block of B[s])
                out = ys if y_idx is None else ys[y_idx]
                tp = t if t_idx is None else t[t_idx]
                _expand_strips(out, tp, group_B[b_idx].to(x.dtype), *shape,
                               self.weights.tile_width)


def _part_indices(slot: int, r: int, d_out: int, parts: tuple[Part, ...]) -> tuple[PartIndex, ...]:
    out = []
    for o0, o1, c0, c1, boff in parts:
        all_rows, all_cols = (o0, o1) == (0, padded_rank(r)), (c0, c1) == (0, d_out)  # t is padded
        t_idx = None if all_rows else (slice(None), slice(o0, o1))
        y_idx = None if all_cols else (slice(None), slice(c0, c1))
        b_idx = (slot, slice(boff, boff + (o1 - o0) * (c1 - c0)))
        out.append((t_idx, y_idx, b_idx, (o1 - o0, c1 - c0)))
    return tuple(out)


def _expand_strips(out: torch.Tensor, t: torch.Tensor, block: torch.Tensor, r: int,
                   d: int, w: int) -> None:
    """out [n, d] += t [n, r] @ B.T, B.T stored in `block` as [r, w] column strips and a
    narrower last strip (layout.b_strips): one batched matmul over the whole strips."""
    n, full = out.shape[0], d // w * w
    if full:
        strips = block[: r * full].view(full // w, r, w)  # [k, r, w]
        delta = torch.matmul(t, strips)  # [k, n, w]
        out[:, :full].view(n, full // w, w).add_(delta.transpose(0, 1))
    if full < d:
        out[:, full:].addmm_(t, block[r * full :].view(r, d - full))
