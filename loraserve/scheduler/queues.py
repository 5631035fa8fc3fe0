"""The request queues a scheduler keeps: waiting (fair insertion across client requests),
running (in admission order: the last is preempted first) and paused (their clients do not
read). Moving a request between them, ending it, and checking that every live request is in
exactly one queue, in the state that queue means. What runs in a step is scheduler.py's."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from loraserve.config import EngineConfig
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request, RequestStatus
from loraserve.scheduler.admission import AdapterResidency
from loraserve.scheduler.fair_share import VirtualTokenCounter
from loraserve.types import FinishReason


class RequestQueues:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, adapters: AdapterResidency,
                 context_cost: float = 0.0):
        self.config = config
        self.kv = kv
        self.adapters = adapters
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.paused: dict[str, Request] = {}  # their clients do not read (see pause())
        self.vtc = VirtualTokenCounter(config.fair_decode_weight, context_cost)

    def add(self, req: Request) -> None:
        """Queue a request, fairly across origins: the k-th waiting request of a client
        request goes behind every other origin's k-th, so one client's fan-out (n x prompts)
        cannot hold everyone else's requests behind all of its own. Requests without an
        origin (the offline API) are first come, first served."""
        self.vtc.arrive(req)
        if req.origin is None:
            self.waiting.append(req)
            return
        mine = sum(1 for r in self.waiting if r.origin == req.origin)
        seen: dict[str | None, int] = {}
        for i, r in enumerate(self.waiting):
            rank = seen[r.origin] = seen.get(r.origin, -1) + 1
            if r.origin is not None and r.origin != req.origin and rank > mine:
                self.waiting.insert(i, req)
                return
        self.waiting.append(req)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None,
               error_status: int | None = None) -> None:
        """End a request for any reason: out of the queues, its blocks back. Idempotent."""
        if req.is_finished:
            return
        if req.status is RequestStatus.PAUSED:
            del self.paused[req.request_id]
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.vtc.leave(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.error_status = error_status

    def fail_waiting(self, errors: Mapping[int, str]) -> list[Request]:
        """End every waiting request of an adapter whose load failed (uid -> why): the
        adapter the client named cannot be served, a 400 for it, nobody else's business."""
        failed = [r for r in self.waiting if r.adapter_uid in errors]
        for r in failed:
            self.finish(r, FinishReason.ERROR, errors[r.adapter_uid], error_status=400)
        return failed

    def pause(self, req: Request) -> bool:
        """Take a live request out of scheduling until `resume`: its client stopped reading
        its stream, so it gives back its seat and its K/V (recomputed on resume; the prefix
        cache keeps its full blocks while nobody needs them). False if it was not live."""
        if req.is_finished or req.status is RequestStatus.PAUSED:
            return False
        if req in self.running:
            self.running.remove(req)
            self.kv.free(req)
            req.num_computed_tokens = 0
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.PAUSED
        req.paused_at = time.monotonic()
        self.paused[req.request_id] = req
        return True

    def resume(self, req: Request) -> bool:
        """Back to the head of the waiting queue (it was admitted once already)."""
        if self.paused.pop(req.request_id, None) is None:
            return False
        req.status = RequestStatus.WAITING
        req.paused_at = None
        self.waiting.appendleft(req)
        return True

    def stalled(self, timeout_s: float) -> list[Request]:
        """Paused requests whose client has not read for `timeout_s` seconds."""
        now = time.monotonic()
        return [r for r in self.paused.values() if now - r.paused_at >= timeout_s]

    def running_adapters(self) -> set[int]:
        return {r.adapter_uid for r in self.running if r.adapter_uid is not None}

    def waiting_adapters(self) -> list[int]:
        """Adapters the waiting queue needs, in queue order, without repeats."""
        seen: dict[int, None] = {}
        for r in self.waiting:
            if r.adapter_uid is not None:
                seen.setdefault(r.adapter_uid, None)
        return list(seen)

    def check(self) -> list[str]:
        """The queues' own consistency: each live request in exactly one queue, in the state
        that queue means; waiting and paused ones hold no KV; the running batch within its caps."""
        problems = []
        ids = [r.request_id for r in (*self.running, *self.waiting, *self.paused.values())]
        if len(ids) != len(set(ids)):
            problems.append("a request is queued twice")
        for queue, status in ((self.running, RequestStatus.RUNNING),
                              (self.waiting, RequestStatus.WAITING)):
            for r in queue:
                if r.status is not status:
                    problems.append(f"{r.request_id} is {r.status.value} in the "
                                    f"{status.value} queue")
        for r in self.paused.values():
            if r.status is not RequestStatus.PAUSED:
                problems.append(f"{r.request_id} is {r.status.value} among the paused")
        held = [r.request_id for r in (*self.waiting, *self.paused.values()) if r.block_table]
        if held:
            problems.append(f"waiting requests hold KV blocks: {held[:4]}")
        cap = self.adapters.batch_cap
        distinct = {r.adapter_uid for r in self.running}
        if cap is not None and len(distinct) > cap:
            problems.append(f"{len(distinct)} distinct adapters run; the cap is {cap}")
        if len(self.running) > self.config.max_num_seqs:
            problems.append(f"{len(self.running)} running, over max_num_seqs")
        return problems

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
