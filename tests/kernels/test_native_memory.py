"""Native memory freed across threads goes back to the OS (else RSS climbs under churn):
adapter-sized tensors allocated on a worker thread and freed on another stay resident until
`release_free_memory` trims the arenas; the engine trims between steps, at most every
interval."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from loraserve.ops import native_memory
from loraserve.ops.native_memory import MemoryTrimmer, release_free_memory


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(native_memory._malloc_trim is None, reason="not glibc")
def test_memory_freed_on_another_thread_is_returned_by_a_trim():
    held: list[torch.Tensor] = []

    def loader():  # like the disk loader: many small tensors, the size of an adapter's
        held.extend(torch.ones(9000) for _ in range(8000))  # ~290 MB of 36 KB tensors

    t = threading.Thread(target=loader)
    t.start()
    t.join()
    keep = held[::8]  # a few stay alive (packed elsewhere, in use): the heap is fragmented
    held.clear()
    before = rss_mb()
    assert release_free_memory()
    after = rss_mb()
    assert before - after > 100, (before, after)
    assert len(keep) == 1000


def test_the_trimmer_trims_at_most_once_per_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(native_memory, "release_free_memory", lambda: calls.append(1))
    monkeypatch.setattr(native_memory, "_malloc_trim", object())
    clock = iter([0.0, 1.0, 4.0, 6.0, 6.0, 7.0])  # each read of the clock, in order
    monkeypatch.setattr(native_memory.time, "monotonic", lambda: next(clock))
    trimmer = MemoryTrimmer(interval_s=5.0)  # created at t=0
    trimmer.maybe_trim()  # t=1
    trimmer.maybe_trim()  # t=4
    assert calls == []
    trimmer.maybe_trim()  # t=6: trims, done at t=6
    assert calls == [1] and trimmer.trims == 1
    trimmer.maybe_trim()  # t=7: too soon after
    assert calls == [1]
