"""The `cpu` LoRA backend: the C kernel (lora/sgmv_cpu.c), one call per layer and group for
every segment of the step, decodes and long prompts alike (faster than oneDNN's GEMMs even for
one long prompt; benchmarks/kernels/lora_op_micro.py re-measures it).

Where the projection runs on our GEMM (ops/gemm_cpu.c), `project` fuses the two (lora/
gemm_lora_cpu.py), with the same results bit for bit: for long segments each x block's
shrink runs while the block is in L2 for the GEMM, and the expand in the GEMM's tiles (y is
written once; AVX-512 builds only, where it is the faster); at decode
the shrink and expand are interleaved with the GEMM, their adapter weights prefetched under
its arithmetic."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from loraserve.lora import gemm_lora_cpu, sgmv_cpu
from loraserve.lora.backends.base import LoraBackend, LoraPlan
from loraserve.lora.batch import LoraBatch, SlotWeights
from loraserve.lora.layout import padded_rank
from loraserve.ops.native_lora import NativeLoraStep, pack_step, weight_table

# Segments at least this long on average take the expand fused into the GEMM's tiles; shorter
# ones (decode) the interleaved op: there a segment's own tiles would be too short for the
# GEMM, and what costs is reading the weights.
FUSE_MIN_TOKENS = 16

# The kernel's view of one group: int64 rows of sgmv_cpu.SEG_FIELDS and of
# sgmv_cpu.PART_FIELDS (lora/lora_rows.h reads them as structs), the widest rank, and the fused
# decode call where a decode step takes one (else None).
KernelPlan = tuple[torch.Tensor, torch.Tensor, int, "gemm_lora_cpu.DecodeCall | None"]


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
        f32 = weights.dtype == torch.float32
        self.expand_lib = gemm_lora_cpu.load_expand() if f32 else None
        self.decode_lib = gemm_lora_cpu.load_decode() if f32 else None
        unit = gemm_lora_cpu.unit(self.expand_lib) if self.expand_lib is not None else 0
        # long segments: the expand in the GEMM's tiles where that build is the faster one
        self.fuse_prefill = unit > 0 and gemm_lora_cpu.expand_preferred(self.expand_lib)
        # groups whose every module (and the B strips) are whole tile units wide
        self.fusable = {g for g, lay in weights.layouts.items()
                        if unit and weights.tile_width % unit == 0
                        and all(d % unit == 0 for d in lay.d_outs)}
        # every layer's pool addresses for the C decode loop (native_step), and the pool
        # generation they were taken at: a grown pool's old tensors are freed
        self._native_tables: tuple[int, torch.Tensor | None] | None = None

    def plan_group(self, batch: LoraBatch, group: str,
                   segments: list[tuple[int, int, int, int]]) -> KernelPlan:
        parts = [(i, o0, o1, c0, c1, boff) for i, (s, *_) in enumerate(segments)
                 for o0, o1, c0, c1, boff in self.weights.parts(s, group)]
        dev = self.weights.device
        segs = torch.tensor(segments, dtype=torch.int64, device=dev)
        parts_t = torch.tensor(parts, dtype=torch.int64, device=dev)
        max_rank = max(r for *_, r in segments)
        decode = None
        if (group in self.fusable and self.decode_lib is not None
                and batch.num_tokens < FUSE_MIN_TOKENS * len(segments)):
            decode = gemm_lora_cpu.DecodeCall(self.decode_lib, segs, parts_t, max_rank,
                                              batch.num_tokens, self.weights.tile_width)
        return segs, parts_t, max_rank, decode

    def project(self, plan: LoraPlan, layer: int, group: str, x: torch.Tensor,
                linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        data = plan.groups.get(group)
        panels = getattr(linear, "panels", None)  # None: not our GEMM
        if (data is None or panels is None or group not in self.fusable
                or hasattr(linear, "bias") or x.dtype != torch.float32):  # bias: added first
            return super().project(plan, layer, group, x, linear)
        if x.stride(-1) != 1:
            x = x.contiguous()
        segs, parts, max_rank, decode = data
        A, B = self.weights.A[layer][group], self.weights.B[layer][group]
        if decode is not None:
            y = decode(x, panels, linear.out_features, A, B)
        elif self.fuse_prefill and x.shape[0] >= FUSE_MIN_TOKENS * segs.shape[0]:
            y = gemm_lora_cpu.gemm_expand(self.expand_lib, x, panels, linear.out_features, A,
                                          B, segs, parts, max_rank, self.weights.tile_width)
        else:
            return super().project(plan, layer, group, x, linear)
        return super().project(plan, layer, group, x, linear) if y is None else y

    def native_step(self, plan: LoraPlan) -> NativeLoraStep | None:
        """The same lora_sgmv calls `apply_group` makes, for the C decode loop to make."""
        tables = None if plan.extras else self._pool_table()
        if tables is None:
            return None
        A, B = self.weights.A[0], self.weights.B[0]
        groups = {g: (segs, parts, A[g].stride(0), B[g].stride(0), self.weights.layouts[g].d_in)
                  for g, (segs, parts, _, _) in plan.groups.items()}
        ldt = padded_rank(max((data[2] for data in plan.groups.values()), default=1))
        fn = ctypes.cast(self.kernel.lora_sgmv, ctypes.c_void_p).value
        return pack_step(fn, self.weights.tile_width, ldt, tables, groups)

    def _pool_table(self) -> torch.Tensor | None:
        """The pool's addresses as the C loop takes them, taken again after the pool grew; None
        where it cannot take them (a group missing from a layer, or a group's slot strides
        differ between layers) or the pool is not in CPU memory."""
        w = self.weights
        if w.device.type != "cpu":
            return None
        if self._native_tables is None or self._native_tables[0] != w.generation:
            self._native_tables = (w.generation, weight_table(w.A, w.B))
        return self._native_tables[1]

    def apply_group(self, plan: KernelPlan, group_A: torch.Tensor, group_B: torch.Tensor,
                    x: torch.Tensor, y: torch.Tensor) -> None:
        sgmv_cpu.sgmv(self.kernel, x, y, group_A, group_B, *plan[:3], self.weights.tile_width)
