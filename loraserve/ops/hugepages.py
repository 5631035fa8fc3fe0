"""Large CPU tensors on 2 MB pages, where Linux gives them (transparent huge pages).

Why: a decode step streams every adapter's weights and the base weights, hundreds of MB,
page after page; on 4 KB pages every page is a TLB miss and a page walk, and the LoRA op's
prefetches wait on them. With the adapter memory and the packed weights on 2 MB pages the
decode LoRA op adds less to a step (benchmarks/kernels/fused_lora.py re-measures it, in
alternating runs; the figures are in docs/benchmarks.md).

Most hosts run THP in `madvise` mode (only regions that ask get huge pages), so the tensor is
aligned to 2 MB and the range advised (MADV_HUGEPAGE) before its first touch. Elsewhere (no
THP, not Linux, a GPU tensor) these are plain tensors: same values, 4 KB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys

import torch

log = logging.getLogger("loraserve.memory")

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE  # smaller tensors could not hold one huge page
_MADV_HUGEPAGE = 14

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def empty_huge(*shape: int, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """torch.empty(shape), on 2 MB pages where the OS gives them (see the module docstring):
    zeros_huge's memory, whose pages are untouched until the first write faults them in."""
    return zeros_huge(*shape, dtype=dtype, device=device)


def zeros_huge(*shape: int, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """torch.zeros(shape), on 2 MB pages where the OS gives them, none of them touched yet:
    an anonymous mapping, which the kernel fills with zeros page by page on first touch. A
    tensor sized for the worst case (the adapter slots) then holds memory only where it is
    written, as torch.zeros' calloc does, and costs no pass of writes to make."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if torch.device(device).type != "cpu" or _madvise is None or nbytes < MIN_BYTES:
        return torch.zeros(*shape, dtype=dtype, device=device)
    # private: a shared anonymous mapping is shmem, which THP leaves on small pages
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # kept by the tensor
    raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    t = raw[skip : skip + nbytes].view(dtype).view(*shape)
    if _madvise(t.data_ptr(), nbytes, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    return t
