"""Copies of packed adapter slots into GPU memory on a side stream, and when a step may read
them.

On CPU the slot pool is host memory and a slot is packed in place: the pool does not use this.
On a GPU a slot is packed on the host into pinned staging buffers and copied on a side stream,
so filling a slot ahead of time (the store's prefetch into spare slots, driven by the waiting
queue) overlaps the steps that run meanwhile. Each slot's latest copy is marked by an event:
- `before_step(slots)` makes the compute stream wait for the events of the slots a step reads
  (a wait queued on the GPU, no host synchronisation);
- a slot is overwritten only after the compute stream's work queued so far, which may still
  read the slot's previous adapter, is done (the side stream waits for it first);
- staging buffers live until their copy has completed (`reap`).
`cuda` is torch.cuda; tests hand in a stand-in with the same Stream / Event / current_stream /
stream names to check the ordering on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class StreamSlotCopies:
    def __init__(self, device: torch.device, cuda: Any = None):
        self.cuda = cuda if cuda is not None else torch.cuda
        self.device = device
        self.stream = self.cuda.Stream(device=device)
        self._pending: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # slot -> (event, bufs)

    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host buffer the copy engine can read asynchronously (pinned)."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.cuda is torch.cuda)

    def write(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (device row, staging buffer) pair, replacing the slot's contents."""
        self.reap()
        self.stream.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = self.cuda.Event()
            event.record(self.stream)
        self._pending[slot] = (event, [src for _, src in pairs])

    def is_ready(self, slot: int) -> bool:
        """Whether the slot's latest copy has completed (a step reading it would not wait)."""
        pending = self._pending.get(slot)
        return pending is None or pending[0].query()

    def before_step(self, slots: Iterable[int]) -> None:
        """Order the compute stream after the copies into `slots` (also before clearing one)."""
        compute = self.cuda.current_stream(self.device)
        for slot in slots:
            pending = self._pending.get(slot)
            if pending is not None:
                compute.wait_event(pending[0])
        self.reap()

    def drain(self) -> None:
        """Wait on the host for every copy (before the pool's tensors are replaced)."""
        self.stream.synchronize()
        self._pending.clear()

    def reap(self) -> None:
        """Drop the staging buffers of completed copies."""
        for slot in [s for s, (event, _) in self._pending.items() if event.query()]:
            del self._pending[slot]

    @property
    def num_pending(self) -> int:
        return len(self._pending)
