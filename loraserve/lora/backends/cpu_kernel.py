"""The `cpu` LoRA backend: the C kernel (lora/sgmv_cpu.c), one call per layer and group for
every segment of the step, decodes and long prompts alike (2.3-2.7x oneDNN's GEMMs even for
one 2048-token prompt; benchmarks/lora_op_micro.py)."""

from __future__ import annotations

import torch

from loraserve.lora import sgmv_cpu
from loraserve.lora.backends.base import LoraBackend
from loraserve.lora.batch import LoraBatch, SlotWeights

# The kernel's view of one group: int64 (slot, start, end, rank) rows, int64 (segment, o0,
# o1, c0, c1, boff) rows, and the widest rank.
KernelPlan = tuple[torch.Tensor, torch.Tensor, int]


class KernelUnavailable(RuntimeError):
    """No C compiler, or the kernel did not build (the warning says why)."""


class CpuKernelLoraBackend(LoraBackend):
    name = "cpu"

    def __init__(self, weights: SlotWeights) -> None:
        super().__init__(weights)
        self.kernel = sgmv_cpu.load(weights.dtype)
        if self.kernel is None:
            raise KernelUnavailable(f"the C LoRA kernel for {weights.dtype} could not be built")
        if not sgmv_cpu.accepts_tile(self.kernel, weights.tile_width):
            raise ValueError(f"the C LoRA kernel built for this CPU reads slot pools of tile "
                             f"width {sgmv_cpu.preferred_tile(self.kernel)}, not "
                             f"{weights.tile_width}")

    def plan_group(self, batch: LoraBatch, group: str,
                   segments: list[tuple[int, int, int, int]]) -> KernelPlan:
        parts = [(i, o0, o1, c0, c1, boff) for i, (s, *_) in enumerate(segments)
                 for o0, o1, c0, c1, boff in self.weights.parts(s, group)]
        dev = self.weights.device
        return (torch.tensor(segments, dtype=torch.int64, device=dev),
                torch.tensor(parts, dtype=torch.int64, device=dev),
                max(r for *_, r in segments))

    def apply_group(self, plan: KernelPlan, group_A: torch.Tensor, group_B: torch.Tensor,
                    x: torch.Tensor, y: torch.Tensor) -> None:
        sgmv_cpu.sgmv(self.kernel, x, y, group_A, group_B, *plan, self.weights.tile_width)
