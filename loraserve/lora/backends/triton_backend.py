"""The `triton` LoRA backend: segmented shrink and expand kernels (lora/triton_sgmv.py), two
launches per layer and group, over the slot pool's packed weights where they are.

For GPUs; on a CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`), which is how
the CPU test suite checks it. triton is imported when this backend is created, never by
`import loraserve`.
"""

from __future__ import annotations

import os

import torch

from loraserve.lora.backends.base import LoraBackend
from loraserve.lora.batch import LoraBatch, SlotWeights
from loraserve.lora.layout import padded_rank

# One group's launches: shrink blocks [n, 4], expand parts [m, 8] (int64, on the device), the
# widest padded rank and the widest module output.
TritonPlan = tuple[torch.Tensor, torch.Tensor, int, int]


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

    def plan_group(self, batch: LoraBatch, group: str,
                   segments: list[tuple[int, int, int, int]]) -> TritonPlan:
        bm = self.kernels.BLOCK_M
        blocks, parts = [], []
        for s, a, b, r in segments:
            for row0 in range(a, b, bm):
                row1 = min(row0 + bm, b)
                blocks.append((s, row0, row1, padded_rank(r)))
                parts.extend((s, row0, row1, o0, o1 - o0, c0, c1 - c0, boff)
                             for o0, o1, c0, c1, boff in self.weights.parts(s, group))
        dev = self.weights.device
        return (torch.tensor(blocks, dtype=torch.int64, device=dev),
                torch.tensor(parts, dtype=torch.int64, device=dev),
                max(b[3] for b in blocks), max(p[6] for p in parts))

    def apply_group(self, plan: TritonPlan, group_A: torch.Tensor, group_B: torch.Tensor,
                    x: torch.Tensor, y: torch.Tensor) -> None:
        blocks, parts, max_rp, max_cols = plan
        if blocks.shape[0] == 0:
            return  # every segment of the group is empty
        # t: [T, widest padded rank] float32; only the segments' rows are written and read
        t = torch.empty(x.shape[0], max_rp, dtype=torch.float32, device=x.device)
        self.kernels.launch_shrink(x, t, group_A, blocks, blocks.shape[0], max_rp,
                                   x.shape[1])
        self.kernels.launch_expand(t, y, group_B, parts, parts.shape[0], max_cols)
