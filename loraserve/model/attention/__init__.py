"""Attention backends over the paged KV cache; one is chosen by name when the engine starts:
`cpu` (C paged decode and prefill attention) and `triton` (GPUs; on a CPU only under
TRITON_INTERPRET=1)."""

from loraserve.model.attention.base import AttentionBackend, AttentionSeq
from loraserve.model.attention.cpu import CpuAttention
from loraserve.model.attention.triton_paged import TritonAttention

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"cpu": CpuAttention,
                                                         "triton": TritonAttention}


def create_attention_backend(name: str, block_size: int, device) -> AttentionBackend:
    try:
        cls = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose from "
                         f"{sorted(ATTENTION_BACKENDS)}") from None
    return cls(block_size, device)


__all__ = ["AttentionBackend", "AttentionSeq", "create_attention_backend"]
