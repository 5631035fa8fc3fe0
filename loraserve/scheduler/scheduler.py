"""Continuous batching: decodes keep running, new requests join, chunked prefill, preemption.

Each step: running requests first (decode or the next prefill chunk), preempting the most
recently admitted when the KV pool is full (recompute); then waiting requests in FCFS order,
subject to the token budget, the KV pool, and adapter admission. The distinct-adapters cap
(base counts as one) is checked here, before anything is committed.
"""

from __future__ import annotations

from collections import deque

from loraserve.config import EngineConfig
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request, RequestStatus
from loraserve.scheduler.batch import AdapterGate, AdapterState, BaseOnlyGate, ScheduledBatch


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, gate: AdapterGate | None = None):
        self.config = config
        self.kv = kv
        self.gate: AdapterGate = gate or BaseOnlyGate()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first

    # --- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and give back its blocks (finish, abort, error)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def running_uids(self) -> set[int | None]:
        return {r.adapter_uid for r in self.running}

    def waiting_uids(self) -> list[int]:
        """Adapters the waiting queue will need, in queue order, without repeats (for prefetch)."""
        seen: dict[int, None] = {}
        for r in self.waiting:
            if r.adapter_uid is not None:
                seen.setdefault(r.adapter_uid, None)
        return list(seen)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.can_allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self.kv.allocate(req, n)
            batch.entries.append((req, n))
            scheduled.add(id(req))
            budget -= n
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        # Recompute: drop its K/V; it rejoins the head of the queue with prompt + output so far.
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        batch.preempted.append(req)
        batch.entries = [(r, n) for r, n in batch.entries if r is not req]

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        cap = self.config.max_loras_per_batch
        running_uids = self.running_uids()
        starving = False
        for req in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            uid = req.adapter_uid
            if uid not in running_uids:
                if len(running_uids | {uid}) > cap:
                    req.blocked_steps += 1
                    # Bounded wait: once the oldest blocked request has waited long enough,
                    # nothing newer is admitted until it fits (running adapters drain).
                    if req.blocked_steps >= self.config.starvation_steps:
                        starving = True
                    if starving:
                        break
                    continue
                if uid is not None:
                    state, why = self.gate.admission(uid, {u for u in running_uids if u})
                    if state is AdapterState.FAILED:
                        self.waiting.remove(req)
                        batch.failed.append((req, why))
                        continue
                    if state is not AdapterState.READY:
                        if state is AdapterState.NO_SLOT:
                            req.blocked_steps += 1
                            starving |= req.blocked_steps >= self.config.starvation_steps
                            if starving:
                                break
                        continue
            elif starving:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.can_allocate(req, n):
                break  # FCFS on memory: a large request is not overtaken forever
            self.kv.allocate(req, n)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            running_uids.add(uid)
            batch.entries.append((req, n))
            budget -= n
