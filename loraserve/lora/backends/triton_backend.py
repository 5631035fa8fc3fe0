"""The `triton` LoRA backend: segmented shrink and expand kernels (lora/triton_sgmv.py), two
launches per layer and group, over the slot pool's packed weights where they are.

For GPUs; on a CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`), which is how
the CPU test suite checks it. triton is imported when this backend is created, never by
`import loraserve`.
"""

from __future__ import annotations

import os

import torch

from loraserve.lora.backends.base import LoraBackend, LoraPlan
from loraserve.lora.batch import LoraBatch, SlotWeights
from loraserve.lora.layout import GROUPS, padded_rank

# One group's launches: shrink blocks [n, 4], expand parts [m, 8] (int64, on the device), the
# widest padded rank, the widest module output and the tokens per block.
TritonPlan = tuple[torch.Tensor, torch.Tensor, int, int, int]


class TritonUnavailable(RuntimeError):
    """triton is not installed, or there is no device it can run on here."""


class TritonLoraBackend(LoraBackend):
    name = "triton"

    def __init__(self, weights: SlotWeights) -> None:
        super().__init__(weights)
        if weights.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise TritonUnavailable("the triton LoRA backend needs a CUDA device (or "
                                    "TRITON_INTERPRET=1 to run its kernels on the CPU)")
        try:
            from loraserve.lora import triton_sgmv
        except ImportError as e:
            raise TritonUnavailable(f"the triton LoRA backend needs triton: {e}") from e
        self.kernels = triton_sgmv
        if weights.tile_width != triton_sgmv.TILE:
            raise ValueError(f"the triton LoRA kernels read slot pools of tile width "
                             f"{triton_sgmv.TILE}, not {weights.tile_width}")

    def plan_group(self, batch: LoraBatch, group: str,
                   segments: list[tuple[int, int, int, int]]) -> TritonPlan:
        bm = self.kernels.rows_per_program([b - a for _, a, b, _ in segments])
        blocks, parts = self._work(group, segments, bm)
        dev = self.weights.device
        return (torch.tensor(blocks, dtype=torch.int64, device=dev),
                torch.tensor(parts, dtype=torch.int64, device=dev),
                max(b[3] for b in blocks), max(p[6] for p in parts), bm)

    def _work(self, group: str, segments: list[tuple[int, int, int, int]], bm: int
              ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """The shrink blocks (of up to `bm` tokens) and expand parts of one group's
        segments."""
        blocks, parts = [], []
        for s, a, b, r in segments:
            for row0 in range(a, b, bm):
                row1 = min(row0 + bm, b)
                blocks.append((s, row0, row1, padded_rank(r)))
                parts.extend((s, row0, row1, o0, o1 - o0, c0, c1 - c0, boff)
                             for o0, o1, c0, c1, boff in self.weights.parts(s, group))
        return blocks, parts

    # --- captured decode steps (engine/cuda_graphs.py) ------------------------------------
    def graph_plan(self, max_tokens: int, take=None) -> LoraPlan:
        """A plan of fixed shapes for up to `max_tokens` tokens: every group's blocks and parts
        sized for the worst case (one block per token), the grids sized for the widest slot.
        A graph captured with it launches the same kernels whatever adapters a later batch
        mixes: `fill_graph_plan` rewrites the tensors, and unused rows are zeros, which the
        kernels skip (padded rank 0, no columns). `take(*shape)` makes each int64 tensor
        (default: zeros on the slot pool's device)."""
        dev, groups = self.weights.device, {}
        take = take or (lambda *shape: torch.zeros(shape, dtype=torch.int64, device=dev))
        for g, lay in self.weights.layouts.items():
            groups[g] = (take(max_tokens, 4), take(max_tokens * len(GROUPS[g]), 8),
                         lay.rank_capacity(self.weights.max_lora_rank), max(lay.d_outs),
                         self.kernels.BLOCK_M)
        return LoraPlan(LoraBatch(max_tokens, ()), groups)

    @staticmethod
    def graph_plan_view(plan: LoraPlan, num_tokens: int) -> LoraPlan:
        """The first `num_tokens` tokens' share of a graph plan (one per batch-size bucket:
        views, so filling the big plan fills every bucket's)."""
        return LoraPlan(LoraBatch(num_tokens, ()), {
            g: (blocks[:num_tokens], parts[:num_tokens * len(GROUPS[g])], rp, cols, bm)
            for g, (blocks, parts, rp, cols, bm) in plan.groups.items()})

    def fill_graph_plan(self, plan: LoraPlan, seq_slots) -> None:
        """Write this step's segments into a graph plan's tensors (rows past them: zeros)."""
        batch = LoraBatch.build(seq_slots, self.weights)
        if batch.num_tokens > plan.batch.num_tokens:
            raise ValueError(f"{batch.num_tokens} tokens in a graph plan for "
                             f"{plan.batch.num_tokens}")
        for g, (blocks_t, parts_t, _, _, bm) in plan.groups.items():
            segs = batch.group_segments(g)
            blocks_t.zero_()
            parts_t.zero_()
            if segs:
                blocks, parts = self._work(g, segs, bm)
                blocks_t[: len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
                parts_t[: len(parts)] = torch.tensor(parts, dtype=torch.int64)

    def apply_group(self, plan: TritonPlan, group_A: torch.Tensor, group_B: torch.Tensor,
                    x: torch.Tensor, y: torch.Tensor) -> None:
        blocks, parts, max_rp, max_cols, bm = plan
        if blocks.shape[0] == 0:
            return  # every segment of the group is empty
        # t: the partial sums over d_in's parts, [splits, T, widest padded rank] float32; only
        # the segments' rows are written and read
        t = torch.empty(self.kernels.k_splits(x.shape[1]), x.shape[0], max_rp,
                        dtype=torch.float32, device=x.device)
        self.kernels.launch_shrink(x, t, group_A, blocks, blocks.shape[0], max_rp,
                                   x.shape[1], bm)
        self.kernels.launch_expand(t, y, group_B, parts, parts.shape[0], max_cols,
                                   self.weights.max_lora_rank, bm)
