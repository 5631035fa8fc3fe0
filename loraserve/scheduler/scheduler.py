"""Continuous batching: decodes keep running, new requests join, chunked prefill, preemption.

`schedule()`: running decodes first, preempting when the KV pool is full (recompute); then the
prefill work, within a per-step budget that keeps decodes at their pace (step_pace.py): next
chunks of running prompts and waiting requests through `Admission.try_add` (admission.py:
every admission rule, once), in fair order between clients (fair_share.py) or FCFS.
The queues themselves, and pausing a request whose client does not read, are queues.py's.
`update_from_output()`: the bookkeeping after the forward pass (computed tokens, sampled
tokens, token-level stops), ending finished requests here. The scheduler never touches tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraserve.config import EngineConfig
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request, RequestStatus
from loraserve.scheduler.admission import AdapterResidency, Admission, Decision
from loraserve.scheduler.batch import ScheduledBatch, StepOutput
from loraserve.scheduler.fair_share import client_key
from loraserve.scheduler.newcomers import Newcomers
from loraserve.scheduler.queues import RequestQueues
from loraserve.scheduler.row_share import split_rows
from loraserve.scheduler.step_pace import StepPace
from loraserve.types import FinishReason


class _NoAdapters:
    """Residency of an engine that serves no adapter (scheduler tests)."""

    def __init__(self, batch_cap: int | None = None):
        self.batch_cap = batch_cap

    def is_ready(self, uid: int) -> bool:
        return False

    def can_bind(self, uids: set[int]) -> bool:
        return not uids


def _origin(req: Request) -> str | None:
    return req.origin


class Scheduler(RequestQueues):
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 adapters: AdapterResidency | None = None, eos_token_ids: Iterable[int] = (),
                 max_model_len: int | None = None, context_cost: float = 0.0):
        # context_cost: ModelConfig.attention_cost_per_position, what fair shares charge for
        # a token's context (fair_share.py)
        super().__init__(config, kv, adapters or _NoAdapters(config.max_loras_per_batch),
                         context_cost)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len or config.max_model_len or 10**9
        self.pace = StepPace(config.decode_pace, config.max_num_batched_tokens)
        # between clients (fair scheduling, several clients): the bound on average, the
        # decodes of clients within their share of seats its reference (row_share.py)
        self.tenant_pace = StepPace(config.tenant_pace_factor, config.max_num_batched_tokens,
                                    average=True) if (
            config.fair_scheduling and config.tenant_pace_factor > 0) else None
        self.last_shared = False  # the last batch was budgeted by the tenant pace too
        # whose share of the batch `request_fair_share` bounds: a client when scheduling is
        # fair, else one client request (its n x prompts)
        self.share_key = client_key if config.fair_scheduling else _origin

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Protected decodes first (a running sequence within its client's share never waits
        behind a prompt), then the paced work, within the step's budget (step_pace.py), in
        fair order between clients (fair_share.py): new admissions, the next chunks of long
        prompts, and the decodes of clients above their share of seats (row_share.py)."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        prefilling, decodes = [], []
        for req in self.running:
            remaining = req.num_tokens - req.num_computed_tokens
            (prefilling if remaining > 1 else decodes).append(req)
        protected, paced, shared = decodes, [], False
        if self.tenant_pace is not None:
            protected, paced = split_rows(decodes, self.running, self.waiting,
                                          self.config.max_num_seqs)
            shared = len({client_key(r) for r in (*self.running, *self.waiting)}) > 1
        self.last_shared = shared
        for req in protected:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted on the way
            if budget > 0 and self._reserve(req, 1, batch):
                batch.add(req, 1)
                budget -= 1
        batch.num_decodes = batch.num_protected = len(batch.entries)
        for req, _ in batch.entries:
            self.vtc.charge(req, decode_tokens=1)
        # one client's decodes are held to the pace of the batch its waiting work will make
        # (step_pace.py); between clients, each decode keeps its own
        rows = 0 if shared else min(self.config.max_num_seqs,
                                    len(self.running) + len(self.waiting))
        paced_budget = self.pace.prefill_budget(batch.num_decodes, bool(prefilling), rows)
        newcomers_only = False
        if shared:  # both bounds hold: the decodes' pace, and the tenant pace on average
            paced_budget = min(paced_budget, self.tenant_pace.prefill_budget(
                batch.num_decodes, bool(prefilling or paced)))
            # a step left to the protected decodes (a reference, or a debt paid back) still
            # gives each client that is new (newcomers.py) its first chunk, min_chunk at most
            newcomers_only = paced_budget == 0
            if newcomers_only:
                paced_budget = budget
        admission = Admission(self.config, self.kv, self.adapters, self.running,
                              min(budget, paced_budget), list(self.waiting), self.share_key)
        self._schedule_paced(batch, admission, prefilling, paced, newcomers_only)
        batch.block_copies = self.kv.take_copies()
        return batch

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """The last scheduled batch took `seconds`: it steers the paces that budgeted it."""
        self.pace.observe(batch.num_decodes, batch.num_tokens - batch.num_decodes, seconds)
        if self.last_shared:
            self.tenant_pace.observe(batch.num_protected,
                                     batch.num_tokens - batch.num_protected, seconds)
        elif self.tenant_pace is not None and batch.num_tokens == batch.num_decodes:
            # a decode-only step costs the same whoever's decodes they are: it is the tenant
            # pace's reference too, so the start-up calibration (one client) seeds it and the
            # first steps between clients are not left decode-only to measure it
            self.tenant_pace.observe(batch.num_decodes, 0, seconds)

    def _reserve(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """KV for `n` more tokens of a running request, preempting (recompute) until they fit;
        False if `req` itself was preempted."""
        while not self.kv.can_allocate(req, n):
            victim = self._victim()
            self._preempt(victim, batch)
            if victim is req:
                return False
        self.kv.allocate(req, n)
        return True

    def _victim(self) -> Request:
        """Who gives back its KV when the pool is full: the most recently admitted request,
        of the most served client when scheduling is fair."""
        if not self.config.fair_scheduling:
            return self.running[-1]
        counter = self.vtc.counter
        i = max(range(len(self.running)),
                key=lambda i: (counter(client_key(self.running[i])), i))
        return self.running[i]

    def _preempt(self, req: Request, batch: ScheduledBatch, for_kv: bool = True) -> None:
        # Recompute: drop its K/V; it rejoins the head of the queue with prompt + output so far.
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        if for_kv:  # the pool is full: nobody is admitted this step
            batch.preempted.append(req)
        batch.drop(req)

    def _make_seat(self, req: Request, batch: ScheduledBatch, admission: Admission) -> bool:
        """Every seat is taken: free one for `req` if its client is owed it (fair_share.py)."""
        if admission.starving or admission.num_seqs < self.config.max_num_seqs:
            return False
        victim = self.vtc.seat_victim(req, self.running, self.waiting, self.config.max_num_seqs)
        if victim is None:
            return False
        self._preempt(victim, batch, for_kv=False)  # recomputed later, from the prefix cache
        admission.release(victim)
        return True

    def _schedule_paced(self, batch: ScheduledBatch, admission: Admission,
                        prefilling: list[Request], paced: list[Request],
                        newcomers_only: bool) -> None:
        """Waiting requests' admission, running prompts' next chunks and paced decodes, in
        fair order (FCFS, running chunks first, when fair scheduling is off).
        `newcomers_only`: only new clients start (newcomers.py). No admission
        in a step that had to preempt: the pool is full."""
        fair = self.config.fair_scheduling
        if fair:
            order = self.vtc.order([*prefilling, *self.waiting, *paced])
        else:
            order = iter([*prefilling, *self.waiting])
        newcomers = (Newcomers(self.running, self.tenant_pace.min_chunk, admission.token_budget)
                     if newcomers_only else None)
        skip: set[str | None] = set()  # clients none of whose requests is admitted this step
        waiting, paced_rows = set(self.waiting), set(paced)  # (one preempted on the way is
        # neither: it comes back in a later step)
        deferred: list[Request] = []
        admitting = True
        for req in order:
            if newcomers is not None:
                if not newcomers.may_take(req, req in paced_rows):
                    continue
                admission.token_budget = newcomers.chunk()
            if req.status is RequestStatus.RUNNING:
                n = min(req.num_tokens - req.num_computed_tokens, admission.token_budget)
                if n <= 0 or not self._reserve(req, n, batch):
                    continue
                admission.token_budget -= n
                if newcomers is not None:
                    newcomers.took(req, n)
                if req in paced_rows:
                    batch.add_decode(req)
                    self.vtc.charge(req, decode_tokens=1)
                else:
                    batch.add(req, n)
                    self.vtc.charge(req, prefill_tokens=n)
            elif admitting and req in waiting and not batch.preempted:
                if req.status is not RequestStatus.WAITING or client_key(req) in skip:
                    continue
                decision, n = admission.try_add(req)
                if decision is Decision.STOP and fair:
                    if self._make_seat(req, batch, admission):
                        decision, n = admission.try_add(req)
                    elif admission.only_seats_full:
                        skip.add(client_key(req))  # no seat for it; a client below its
                        continue  # share may still take one
                if decision is Decision.STOP:
                    admitting = False  # running prompts may still take their chunks
                elif decision is Decision.OVER_SHARE:
                    deferred.append(req)
                elif decision is Decision.ADMIT:
                    self._start(req, n, batch)
                    if newcomers is not None:
                        newcomers.took(req, n)
        if not admitting or batch.preempted or newcomers is not None:
            return
        # What is left after every client had its share goes to the deferred, in order: the
        # share orders admission, it never leaves a seat empty.
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
        self.vtc.charge(req, prefill_tokens=n)

    def update_from_output(self, batch: ScheduledBatch, output: StepOutput) -> list[Request]:
        """Advance every scheduled request by the tokens it computed, append the sampled
        tokens, and end those that hit EOS, a stop token id, max_tokens or the context.
        Returns the requests that got a token, in `output` order, after those that only scored
        their prompt (max_tokens=0) and are now done."""
        for req, n in batch.entries:
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
        by_id = {req.request_id: req for req, _ in batch.entries}
        sampled = []
        for rid, scores in output.prompt_logprobs.items():
            for position, value in scores:
                by_id[rid].prompt_logprobs[position] = value
        for req, _ in batch.entries:  # max_tokens=0: it only scores its prompt; done now
            if req.params.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                self.finish(req, FinishReason.LENGTH)
                sampled.append(req)
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
