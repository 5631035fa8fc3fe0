"""Admission: every rule deciding whether a waiting request joins this step's batch, once.

`try_add` runs the checks first (none has a side effect), then commits what they allowed:
    - sequence limit (max_num_seqs) and token budget (max_num_batched_tokens);
    - the distinct-adapters cap (the store's batch_cap: max_loras_per_batch, the base model
      counting as one; none with one adapter memory on CPU), counting
      every request already in the batch: running ones, chunked prefills, this step's admits;
    - compute slots: the store must be able to bind the batch's adapters at once (pinned ones
      hold theirs); adapter weights must be in host memory (loads start in store.prepare);
    - the KV pool (check, then allocate), first come first served: a request that does not fit
      stops admission rather than being overtaken forever; a prefix found in the cache (or a
      fork parent's prompt) is reused, and only the rest is computed and allocated; a fork
      waits while its parent computes the prompt they share, and any request waits while a
      running one computes the next prompt block it would compute (same tokens, same weights);
    - the starvation bound: once a request has been refused by the cap or the slots for
      `starvation_steps` steps, nothing newer is admitted until it fits;
    - the fair share: while requests of other clients wait, one client's running sequences
      may hold at most `request_fair_share` of max_num_seqs and of the KV cache (counting each
      sequence's prompt + max_tokens); its first sequence always may. Who counts as one
      client is `share_key`'s answer: the client (fair scheduling) or one client request.
      Work-conserving: what is left after every client had its share goes to the deferred
      (the scheduler's second pass), and alone a client may use everything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from enum import Enum
from typing import Protocol

from loraserve.config import EngineConfig
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request


class AdapterResidency(Protocol):
    """What admission asks of the adapter store (adapters/store.py). Pure queries."""

    # distinct adapters one batch may hold, the base model counting as one (None: no cap,
    # as with one adapter memory on CPU, where every host-resident adapter has its slot)
    batch_cap: int | None

    def is_ready(self, uid: int) -> bool:
        """Its weights are in host memory: a slot can be filled from them this step."""
        ...

    def can_bind(self, uids: set[int]) -> bool:
        """These adapters can all hold a compute slot at the same time."""
        ...


class Decision(Enum):
    ADMIT = "admit"
    NOT_READY = "not_ready"  # adapter loading, or its prefix being computed: try a later one
    OVER_SHARE = "over_share"  # its client request holds its fair share: try a later one
    BLOCKED = "blocked"  # the adapter cap or the slots refuse it: counts toward starvation
    STOP = "stop"  # budget, sequence limit, KV pool or a starving request: admit no more


class Admission:
    """One step's admission state, built after the running requests took their share."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, adapters: AdapterResidency,
                 running: list[Request], token_budget: int, waiting: list[Request],
                 share_key: Callable[[Request], str | None] = lambda r: r.origin):
        self.config = config
        self.kv = kv
        self.adapters = adapters
        self.num_seqs = len(running)
        self.token_budget = token_budget
        self.batch_adapters: set[int | None] = {r.adapter_uid for r in running}
        self.starving = False
        self.enforce_share = True
        self.share_key = share_key
        self.waiting_origins = Counter(share_key(r) for r in waiting)
        self.origin_seqs: Counter[str | None] = Counter(share_key(r) for r in running)
        self.origin_tokens: Counter[str | None] = Counter()
        for r in running:
            self.origin_tokens[share_key(r)] += footprint(r)
        share = config.request_fair_share
        self.max_origin_seqs = share * config.max_num_seqs
        self.max_origin_tokens = share * kv.capacity_tokens

    def try_add(self, req: Request) -> tuple[Decision, int]:
        """(decision, tokens it feeds this step if admitted). On ADMIT its KV blocks are
        allocated and the batch's counters updated; on BLOCKED its starvation count grows."""
        if self.starving or self.token_budget == 0 or self.num_seqs >= self.config.max_num_seqs:
            return Decision.STOP, 0
        if self._over_share(req):
            return Decision.OVER_SHARE, 0
        uid = req.adapter_uid
        if uid not in self.batch_adapters:
            cap = self.adapters.batch_cap
            if cap is not None and len(self.batch_adapters) + 1 > cap:
                return self._blocked(req), 0
            if uid is not None:
                if not self.adapters.is_ready(uid):
                    return Decision.NOT_READY, 0
                lora_uids = {u for u in self.batch_adapters if u is not None}
                if not self.adapters.can_bind(lora_uids | {uid}):
                    return self._blocked(req), 0
        if self.kv.waits_for_fork(req):
            return Decision.NOT_READY, 0
        prefix = self.kv.find_prefix(req)
        if self.kv.waits_for_prefix(req, prefix):
            return Decision.NOT_READY, 0
        start = max(req.num_computed_tokens, prefix.num_tokens)
        n = min(req.num_tokens - start, self.token_budget)
        if not self.kv.can_allocate(req, n, prefix):
            return Decision.STOP, 0
        # every check passed: commit
        self.kv.allocate(req, n, prefix)
        self.num_seqs += 1
        self.token_budget -= n
        self.batch_adapters.add(uid)
        origin = self.share_key(req)
        self.waiting_origins[origin] -= 1
        self.origin_seqs[origin] += 1
        self.origin_tokens[origin] += footprint(req)
        return Decision.ADMIT, n

    @property
    def only_seats_full(self) -> bool:
        """STOP said because every seat is taken, and for no other reason (budget, starving)."""
        return (self.num_seqs >= self.config.max_num_seqs and not self.starving
                and self.token_budget > 0)

    def release(self, req: Request) -> None:
        """A running request left the batch (preempted to make room): its seat is free."""
        origin = self.share_key(req)
        self.num_seqs -= 1
        self.origin_seqs[origin] -= 1
        self.origin_tokens[origin] -= footprint(req)

    def _over_share(self, req: Request) -> bool:
        origin = self.share_key(req)
        others_wait = sum(self.waiting_origins.values()) > self.waiting_origins[origin]
        if (not self.enforce_share or origin is None or not others_wait
                or self.origin_seqs[origin] == 0):
            return False
        return (self.origin_seqs[origin] + 1 > self.max_origin_seqs
                or self.origin_tokens[origin] + footprint(req) > self.max_origin_tokens)

    def _blocked(self, req: Request) -> Decision:
        req.blocked_steps += 1
        if req.blocked_steps >= self.config.starvation_steps:
            self.starving = True  # bounded wait: nothing newer goes ahead of it
            return Decision.STOP
        return Decision.BLOCKED


def footprint(req: Request) -> int:
    """The KV tokens a sequence will hold at most: its prompt and every token it may add."""
    return len(req.prompt_token_ids) + req.params.max_tokens
