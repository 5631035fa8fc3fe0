"""Prefetch driven by the waiting queue (S-LoRA): bring the adapters that upcoming requests
need into host memory and spare compute slots before the scheduler asks for them.

Runs on the engine thread between steps and never blocks: disk reads go to HostLoader's
workers; a slot is filled only from host weights already in memory. Prefetched adapters are
marked so that, until a request uses them, they are the first eviction victims.
"""

from __future__ import annotations

from loraserve.adapters.store import AdapterStore


class Prefetcher:
    def __init__(self, store: AdapterStore, max_prefetch: int, window: int | None = None):
        self.store = store
        self.max_prefetch = max_prefetch
        # How far down the queue to look: the next `window` distinct adapters.
        self.window = window or 2 * max_prefetch
        self.loads_started = 0
        self.slots_filled = 0

    def step(self, upcoming: list[int]) -> None:
        """`upcoming`: distinct adapter uids of the waiting queue, in queue order."""
        if self.max_prefetch <= 0 or not upcoming:
            return
        store = self.store
        ahead = upcoming[: self.window]
        protect = set(ahead) | store.running_uids
        in_flight = 0
        for uid in ahead:
            if in_flight >= self.max_prefetch:
                break
            entry = store.entries.get(uid)
            if entry is None or entry.error is not None:
                continue
            if entry.weights is None:
                in_flight += 1
                if not store.loader.is_loading(uid) and store.make_host_room(uid, protect):
                    store.loader.start(uid, entry.path)
                    entry.prefetched = True
                    self.loads_started += 1
            elif entry.slot is None:
                slot = store.pick_slot(protect)
                if slot is None:
                    continue
                store.fill_slot(entry, slot)
                entry.prefetched = True
                in_flight += 1
                self.slots_filled += 1
