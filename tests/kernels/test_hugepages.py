"""ops/hugepages.py: large CPU tensors aligned to 2 MB and advised onto huge pages; the same
values as torch.zeros/empty either way."""

from __future__ import annotations

import sys

import pytest
import torch

from loraserve.ops import hugepages
from loraserve.ops.hugepages import HUGE_PAGE, empty_huge, zeros_huge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_huge_is_zeros_of_the_shape_and_dtype(dtype):
    t = zeros_huge(3, HUGE_PAGE // 2, dtype=dtype)
    assert t.shape == (3, HUGE_PAGE // 2) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[2, -1] = 1  # writable to its last element, and no alias of another tensor
    assert t.sum().item() == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise: Linux only")
def test_a_large_tensor_starts_on_a_huge_page_boundary():
    t = empty_huge(4, HUGE_PAGE // 4)  # 4 MB of float32
    assert t.data_ptr() % HUGE_PAGE == 0


def test_small_tensors_and_no_madvise_are_plain_tensors(monkeypatch):
    small = zeros_huge(4, 4)
    assert small.shape == (4, 4) and not small.any()
    monkeypatch.setattr(hugepages, "_madvise", None)  # not Linux, or no libc
    t = zeros_huge(2, HUGE_PAGE // 4)
    assert t.shape == (2, HUGE_PAGE // 4) and not t.any()


def test_a_refused_madvise_still_gives_the_tensor(monkeypatch):
    monkeypatch.setattr(hugepages, "_madvise", lambda *a: -1)  # e.g. THP off: EINVAL
    t = zeros_huge(2, HUGE_PAGE // 4)
    assert not t.any() and t.numel() == HUGE_PAGE // 2


def _resident_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise: Linux only")
def test_zeros_huge_holds_memory_only_where_written():
    """A worst-case-sized tensor (the KV cache) costs no memory, and no pass of writes, until
    its pages are used; the pages it never wrote read as zeros."""
    before = _resident_kb()
    t = zeros_huge(64, HUGE_PAGE // 4)  # 128 MB of float32
    assert t.data_ptr() % HUGE_PAGE == 0
    assert _resident_kb() - before < 16 * 1024
    t[:2].fill_(1.0)  # two rows: 4 MB
    assert 2 * 1024 < _resident_kb() - before < 32 * 1024
    assert t[:2].eq(1.0).all() and not t[2:].any()
