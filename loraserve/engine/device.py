"""Which device and compute dtype an engine runs on: the choice made, or refused, once."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device | None, dtype: str) -> tuple[torch.device,
                                                                         torch.dtype]:
    """The engine's device and compute dtype; what this machine cannot run is refused here."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: {e}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: loraserve runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU here")
    if dtype == "auto":
        dtype = "float32" if dev.type == "cpu" else "bfloat16"
    if dev.type == "cpu" and dtype != "float32":
        raise ValueError(f"dtype {dtype} needs a GPU: on CPU loraserve computes in float32 "
                         "(faster there than bf16, and what its kernels take)")
    return dev, getattr(torch, dtype)
