"""A model's packed weights side by side on 2 MB pages, in the order they are packed.

Why: a batch-1 decode step streams every projection's weights once, and most of a small
model's weights are under 2 MB each (SmolLM2-135M's int8 q/k/v, o and down projections), too
small for a huge page of their own (ops/hugepages.py gives one only to tensors of 2 MB or
more). On 4 KB pages the hardware prefetchers stop at every page boundary and each page costs
a TLB walk. Packed one after another into shared 2 MB-page chunks, in the order the model
makes them (its forward order), the weights a step reads form a few long runs of huge pages.

A tensor from `empty` is a view of its chunk: the chunk lives as long as any of its views,
so a model's weights free their chunks when the model goes, and a tensor that dies sooner
frees nothing. So only weights that live as long as their model go here (a start-up probe's
weight takes an allocation of its own). Tensors of a chunk's size or more get an allocation
of their own (still on huge pages).
"""

from __future__ import annotations

import threading

import torch

from loraserve.ops.hugepages import empty_huge

# several layers' weights to a chunk (a layer of a small model is a few MB), and at most one
# weight's worth left unused at a chunk's end
CHUNK_BYTES = 32 << 20
ALIGN = 64  # a cache line: every tensor starts on one, as the kernels' loads assume nothing less


class WeightArena:
    """Hands out contiguous tensors one after another from 2 MB-page chunks (a bump allocator:
    nothing is reused; a chunk goes when its last view does)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor, placed right after the last one."""
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        if nbytes >= self.chunk_bytes or nbytes == 0:
            return empty_huge(*shape, dtype=dtype)
        with self._lock:
            if self._chunk is None or self._used + nbytes > self.chunk_bytes:
                self._chunk, self._used = empty_huge(self.chunk_bytes, dtype=torch.uint8), 0
            start = self._used
            self._used += -(-nbytes // ALIGN) * ALIGN
            chunk = self._chunk
        return chunk[start:start + nbytes].view(dtype).view(*shape)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (any layout) as a contiguous tensor in the arena."""
        out = self.empty(*t.shape, dtype=t.dtype)
        out.copy_(t)
        return out


# one per process: the weights of the model being loaded go to one run of chunks
PACKED_WEIGHTS = WeightArena()
