"""LoRA backends, chosen once by name when the engine starts.

`cpu` (the C kernel, default), `torch`, and `triton` (GPUs; on a CPU only under
TRITON_INTERPRET=1). The name comes from `EngineConfig.lora_backend`, else
`$LORASERVE_LORA_BACKEND`, else `cpu`; when the C kernel cannot be built (no compiler), `cpu`
falls back to `torch` with a warning. `triton` never falls back: asked for by name, it either
runs or the engine refuses to start, saying why.
"""

from __future__ import annotations

import logging
import os

import torch

from loraserve.config import LORA_BACKEND_ENV
from loraserve.lora import sgmv_cpu
from loraserve.lora.backends.base import LoraBackend, LoraPlan
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend, KernelUnavailable
from loraserve.lora.backends.torch_matmul import TorchLoraBackend
from loraserve.lora.backends.triton_backend import TritonLoraBackend, TritonUnavailable
from loraserve.lora.batch import SlotWeights
from loraserve.lora.layout import RANK_TILE

log = logging.getLogger("loraserve.lora")

BACKEND_ENV = LORA_BACKEND_ENV
LORA_BACKENDS: dict[str, type[LoraBackend]] = {
    CpuKernelLoraBackend.name: CpuKernelLoraBackend,
    TorchLoraBackend.name: TorchLoraBackend,
    TritonLoraBackend.name: TritonLoraBackend,
}
DEFAULT_BACKEND = CpuKernelLoraBackend.name


def backend_name(name: str | None = None) -> str:
    """The backend `create_lora_backend` will try: `name`, else $LORASERVE_LORA_BACKEND, else
    the default."""
    return (name or os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND).lower()


def pool_tile_width(name: str | None, dtype: torch.dtype, device: torch.device) -> int:
    """The slot pool tile width (layout.py) the backend `name` runs fastest on: the C kernel's
    preferred width when it is the one that will run (16 on AVX2 builds), else the default
    every backend reads."""
    if backend_name(name) == CpuKernelLoraBackend.name and device.type == "cpu":
        lib = sgmv_cpu.load(dtype) if dtype in sgmv_cpu.WEIGHT_FLAGS else None
        if lib is not None:
            return sgmv_cpu.preferred_tile(lib)
    return RANK_TILE


def create_lora_backend(weights: SlotWeights, name: str | None = None) -> LoraBackend:
    name = backend_name(name)
    cls = LORA_BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"unknown LoRA backend {name!r} (from lora_backend or ${BACKEND_ENV});"
                         f" choose from {sorted(LORA_BACKENDS)}")
    try:
        return cls(weights)
    except KernelUnavailable as e:
        log.warning("%s; using the torch LoRA backend", e)
        return TorchLoraBackend(weights)
    except TritonUnavailable as e:
        raise ValueError(str(e)) from e


__all__ = ["LORA_BACKENDS", "LoraBackend", "LoraPlan", "backend_name", "create_lora_backend",
           "pool_tile_width"]
