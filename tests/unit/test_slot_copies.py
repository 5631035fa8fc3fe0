"""Slot copies on a side stream (adapters/slot_copies.py), checked on CPU with a stand-in for
torch.cuda whose copies stay in flight until the test completes them: the pool's staged
writes give exactly the bytes of an in-place write, a step waits for the copies of the slots
it reads, a slot is overwritten only after the compute stream's earlier work, and staging
buffers live until their copy is done."""

from __future__ import annotations

import contextlib

import torch
from test_lora_ops import CFG, MAX_RANK, make_adapter

from loraserve.adapters.slot_copies import StreamSlotCopies
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.config import LORA_MODULES
from loraserve.lora.layout import GROUPS


class Event:
    def __init__(self, log):
        self.log, self.done, self.copies = log, False, []

    def record(self, stream):
        self.copies, stream.queued = stream.queued, []

    def query(self):
        return self.done

    def complete(self):
        for dst, src in self.copies:
            dst.copy_(src)
        self.done = True


class Stream:
    def __init__(self, log, name="side", device=None):
        self.log, self.name, self.queued = log, name, []

    def wait_stream(self, other):
        self.log.append(("side waits for", other.name))

    def wait_event(self, event):
        self.log.append((f"{self.name} waits for event", event))

    def synchronize(self):
        self.log.append(("side synchronized",))


class FakeCuda:
    """Copies issued inside `stream(side)` are queued, not done, until their event completes."""

    def __init__(self):
        self.log, self.events, self._in = [], [], None
        self.compute = Stream(self.log, "compute")
        self.Stream = lambda device=None: Stream(self.log)

    def Event(self):  # noqa: N802  (torch.cuda's name)
        self.events.append(Event(self.log))
        return self.events[-1]

    def current_stream(self, device=None):
        return self.compute

    @contextlib.contextmanager
    def stream(self, s):
        real_copy = torch.Tensor.copy_

        def queued_copy(dst, src, non_blocking=False):
            assert non_blocking, "side-stream copies must not block the host"
            s.queued.append((dst, src.clone()))
            return dst

        torch.Tensor.copy_ = queued_copy
        try:
            yield
        finally:
            torch.Tensor.copy_ = real_copy


def test_staged_writes_land_the_same_bytes_after_their_copy():
    cuda = FakeCuda()
    staged = LoraSlotPool(CFG, 2, MAX_RANK, copies=StreamSlotCopies(torch.device("cpu"), cuda))
    plain = LoraSlotPool(CFG, 2, MAX_RANK)
    first, second = make_adapter(10, 32, LORA_MODULES), make_adapter(11, 8, ("q_proj",))
    for pool in (staged, plain):
        pool.write(1, first)
    assert all(float(t[1].abs().sum()) == 0 for d in staged.A for t in d.values())  # in flight
    assert not staged.copies.is_ready(1) and staged.copies.num_pending == 1
    staged.before_step([1])
    assert cuda.log[-1] == ("compute waits for event", cuda.events[0])
    cuda.events[0].complete()
    staged.write(1, second)  # a new adapter in the same slot: ordered after the compute stream
    assert ("side waits for", "compute") in cuda.log
    assert staged.copies.num_pending == 1  # the first copy is done: its buffers are dropped
    plain.write(1, second)
    cuda.events[1].complete()
    staged.before_step([1])
    assert staged.copies.num_pending == 0
    for layer in range(CFG.num_hidden_layers):
        for g in GROUPS:
            assert torch.equal(staged.A[layer][g], plain.A[layer][g])
            assert torch.equal(staged.B[layer][g], plain.B[layer][g])
    assert staged.parts(1, "qkv") == plain.parts(1, "qkv")


def test_growing_or_clearing_a_slot_waits_for_its_copies():
    cuda = FakeCuda()
    pool = LoraSlotPool(CFG, 1, MAX_RANK, copies=StreamSlotCopies(torch.device("cpu"), cuda))
    pool.write(0, make_adapter(12, 16, LORA_MODULES))
    pool.clear(0)
    assert ("compute waits for event", cuda.events[0]) in cuda.log
    pool.grow(3)
    assert cuda.log[-1] == ("side synchronized",) and pool.copies.num_pending == 0
