"""Continuous batching: decodes keep running, new requests join, chunked prefill, preemption.

`schedule()`: running requests first (a decode or the next prefill chunk), preempting the most
recently admitted when the KV pool is full (recompute); then waiting requests in FCFS order
through `Admission.try_add` (scheduler/admission.py: every admission rule, once).
`update_from_output()`: the bookkeeping after the forward pass (computed tokens, sampled
tokens, token-level stops), ending finished requests here. The scheduler never touches tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from loraserve.config import EngineConfig
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request, RequestStatus
from loraserve.scheduler.admission import AdapterResidency, Admission, Decision
from loraserve.scheduler.batch import ScheduledBatch, StepOutput
from loraserve.types import FinishReason


class _NoAdapters:
    """Residency of an engine that serves no adapter (scheduler tests)."""

    def __init__(self, batch_cap: int | None = None):
        self.batch_cap = batch_cap

    def is_ready(self, uid: int) -> bool:
        return False

    def can_bind(self, uids: set[int]) -> bool:
        return not uids


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 adapters: AdapterResidency | None = None, eos_token_ids: Iterable[int] = (),
                 max_model_len: int | None = None):
        self.config = config
        self.kv = kv
        self.adapters: AdapterResidency = adapters or _NoAdapters(config.max_loras_per_batch)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len or config.max_model_len or 10**9
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first

    # --- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request, fairly across origins: the k-th waiting request of a client
        request goes behind every other origin's k-th, so one client's fan-out (n x prompts)
        cannot hold everyone else's requests behind all of its own. Requests without an
        origin (the offline API) are first come, first served."""
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
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
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
        that queue means; waiting ones hold no KV; the running batch within its caps."""
        problems = []
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        if len(ids) != len(set(ids)):
            problems.append("a request is queued twice")
        for queue, status in ((self.running, RequestStatus.RUNNING),
                              (self.waiting, RequestStatus.WAITING)):
            for r in queue:
                if r.status is not status:
                    problems.append(f"{r.request_id} is {r.status.value} in the "
                                    f"{status.value} queue")
        held = [r.request_id for r in self.waiting if r.block_table]
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

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
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
            batch.add(req, n)
            budget -= n
        if not batch.preempted:
            self._admit_waiting(batch, Admission(self.config, self.kv, self.adapters,
                                                 self.running, budget, list(self.waiting)))
        batch.block_copies = self.kv.take_copies()
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
        batch.drop(req)

    def _admit_waiting(self, batch: ScheduledBatch, admission: Admission) -> None:
        deferred = []
        for req in list(self.waiting):
            decision, n = admission.try_add(req)
            if decision is Decision.STOP:
                return
            if decision is Decision.OVER_SHARE:
                deferred.append(req)
            elif decision is Decision.ADMIT:
                self._start(req, n, batch)
        # What is left after every origin had its share goes to the deferred, in queue order:
        # the share orders admission, it never leaves a seat empty.
        admission.enforce_share = False
        for req in deferred:
            decision, n = admission.try_add(req)
            if decision is Decision.STOP:
                return
            if decision is Decision.ADMIT:
                self._start(req, n, batch)

    def _start(self, req: Request, n: int, batch: ScheduledBatch) -> None:
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        batch.add(req, n)
        batch.admitted.append(req)

    def update_from_output(self, batch: ScheduledBatch, output: StepOutput) -> list[Request]:
        """Advance every scheduled request by the tokens it computed, append the sampled
        tokens, and end those that hit EOS, a stop token id, max_tokens or the context.
        Returns the requests that got a token, in `output` order."""
        for req, n in batch.entries:
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
        by_id = {req.request_id: req for req, _ in batch.entries}
        sampled = []
        for i, (rid, token) in enumerate(zip(output.request_ids, output.token_ids, strict=True)):
            req = by_id[rid]
            lp = output.logprobs[i] if output.logprobs is not None else None
            top = output.top_logprobs[i] if output.top_logprobs is not None else None
            req.append_token(token, lp, top)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
            sampled.append(req)
        return sampled

    def end_without_token(self, batch: ScheduledBatch, output: StepOutput) -> list[Request]:
        """End the requests the step could give no token (StepOutput.ended)."""
        by_id = {req.request_id: req for req, _ in batch.entries}
        ended = []
        for rid, reason in output.ended:
            self.finish(by_id[rid], reason)
            ended.append(by_id[rid])
        return ended

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        # A grammar allows EOS only once its text is complete: then EOS ends it, ignore_eos or not.
        eos_stops = not p.ignore_eos or req.grammar is not None
        stop = token in p.stop_token_ids or (eos_stops and token in self.eos_token_ids)
        if stop and req.num_output_tokens > p.min_tokens:  # the sampler masks them before
            return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
