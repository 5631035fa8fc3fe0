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

from loraserve.lora.backends.base import LoraBackend, LoraPlan
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend, KernelUnavailable
from loraserve.lora.backends.torch_matmul import TorchLoraBackend
from loraserve.lora.backends.triton_backend import TritonLoraBackend, TritonUnavailable
from loraserve.lora.batch import SlotWeights

log = logging.getLogger("loraserve.lora")

BACKEND_ENV = "LORASERVE_LORA_BACKEND"
LORA_BACKENDS: dict[str, type[LoraBackend]] = {
    CpuKernelLoraBackend.name: CpuKernelLoraBackend,
    TorchLoraBackend.name: TorchLoraBackend,
    TritonLoraBackend.name: TritonLoraBackend,
}
DEFAULT_BACKEND = CpuKernelLoraBackend.name


def create_lora_backend(weights: SlotWeights, name: str | None = None) -> LoraBackend:
    name = (name or os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND).lower()
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


__all__ = ["LORA_BACKENDS", "LoraBackend", "LoraPlan", "create_lora_backend"]
