"""Property-based test (hypothesis, stateful) of the block pool with the prefix cache.

Random sequences of add / admit (prefix hits, fork copies, chunked prefill) / compute /
decode / fork / finish / abort / preempt / cache reset keep every invariant of the KV cache
manager's own check, and two that only a model of the contents can see: a block is never
written while another request shares it, and a block reused from the cache or a fork parent
holds exactly the tokens, under exactly the namespace, that the reusing request expects.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loraserve.kvcache.manager import KVCacheManager
from loraserve.kvcache.prefix_hash import extend_block_hashes
from loraserve.request import Request, RequestStatus
from loraserve.types import SamplingParams

BS = 4
# prompts share prefixes so the cache hits, in two namespaces so it must not hit across them
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5], []]


def expected_hashes(req: Request) -> list[bytes]:
    return extend_block_hashes([], req.cache_namespace, req.all_token_ids, BS, req.num_tokens)


class KVMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=14, block_size=BS, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.scheduled: dict[str, int] = {}  # tokens allocated for the next compute
        self.content: dict[int, bytes] = {}  # block -> hash of the full block written there
        self.ids = itertools.count()

    def _new(self, prompt, ns, parent=None) -> Request:
        req = Request(f"r{next(self.ids)}", prompt, SamplingParams(max_tokens=64),
                      cache_namespace=ns, fork_parent=parent)
        self.live[req.request_id] = req
        return req

    def _pick(self, i: int, want) -> Request | None:
        reqs = [r for r in self.live.values() if want(r)]
        return reqs[i % len(reqs)] if reqs else None

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 9), max_size=6),
          ns=st.sampled_from([b"A", b"B"]))
    def add(self, prefix, tail, ns):
        self._new(prefix + tail or [0], ns)

    def _any(self, want) -> bool:
        return any(want(r) for r in self.live.values())

    @precondition(lambda self: self._any(lambda r: not r.output_token_ids))
    @rule(i=st.integers(0, 50))
    def fork(self, i):
        p = self._pick(i, lambda r: not r.output_token_ids)
        if p is not None:
            self._new(p.prompt_token_ids, p.cache_namespace, parent=p)

    @precondition(lambda self: self._any(lambda r: r.status is RequestStatus.WAITING))
    @rule(i=st.integers(0, 50), chunk=st.integers(1, 12))
    def admit(self, i, chunk):
        req = self._pick(i, lambda r: r.status is RequestStatus.WAITING)
        if req is None or self.kv.waits_for_fork(req):
            return
        prefix = self.kv.find_prefix(req)
        if self.kv.waits_for_prefix(req, prefix):
            return
        want = expected_hashes(req)
        for k, b in enumerate(prefix.blocks):  # reused K/V is exactly what this one needs
            assert self.content.get(b) == want[k], "a reused block holds other tokens"
        start = max(req.num_computed_tokens, prefix.num_tokens)
        n = min(req.num_tokens - start, chunk)
        if self.kv.can_allocate(req, n, prefix):
            self.kv.allocate(req, n, prefix)
            req.status = RequestStatus.RUNNING
            self.scheduled[req.request_id] = n
            for src, dst in self.kv.take_copies():  # the runner copies in the same step
                assert self.kv.pool.ref[dst] == 1 and self.kv.pool.ref[src] > 0
                self.content.pop(dst, None)  # a partial block: never a full cached one

    @precondition(lambda self: self._any(_needs_chunk(self)))
    @rule(i=st.integers(0, 50), chunk=st.integers(1, 12))
    def next_chunk(self, i, chunk):
        req = self._pick(i, _needs_chunk(self))
        n = min(req.num_tokens - req.num_computed_tokens, chunk)
        if n and self.kv.can_allocate(req, n):
            self.kv.allocate(req, n)
            self.scheduled[req.request_id] = n

    @precondition(lambda self: self.scheduled)
    @rule(i=st.integers(0, 50))
    def compute(self, i):
        req = self._pick(i, lambda r: r.request_id in self.scheduled)
        n = self.scheduled.pop(req.request_id)
        old, new = req.num_computed_tokens, req.num_computed_tokens + n
        want = expected_hashes(req)
        for k in range(old // BS, -(-new // BS)):
            b = req.block_table[k]
            assert self.kv.pool.ref[b] == 1, "writing into a block another request shares"
            if (k + 1) * BS <= new:
                self.content[b] = want[k]
            else:
                self.content.pop(b, None)  # partial: nobody may reuse it as a full block
        req.num_computed_tokens = new
        self.kv.cache_full_blocks(req)

    @precondition(lambda self: self._any(_can_decode(self)))
    @rule(i=st.integers(0, 50), token=st.integers(0, 9))
    def decode(self, i, token):
        req = self._pick(i, _can_decode(self))
        req.append_token(token)
        if self.kv.can_allocate(req, 1):
            self.kv.allocate(req, 1)
            self.scheduled[req.request_id] = 1
        else:
            self._preempt(req)

    def _preempt(self, req):
        self.kv.free(req)
        self.scheduled.pop(req.request_id, None)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING

    @precondition(lambda self: self._any(lambda r: r.status is RequestStatus.RUNNING))
    @rule(i=st.integers(0, 50))
    def preempt(self, i):
        req = self._pick(i, lambda r: r.status is RequestStatus.RUNNING)
        if req is not None:
            self._preempt(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def finish_or_abort(self, i):
        req = self._pick(i, lambda r: True)
        self.kv.free(req)
        self.kv.free(req)  # ending twice (finish, then a late abort) is harmless
        self.scheduled.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        del self.live[req.request_id]

    @rule()
    def reset_cache(self):
        self.kv.pool.reset_cache()

    @precondition(lambda self: not self.scheduled)
    @invariant()
    def consistent(self):
        assert self.kv.check(self.live.values()) == []
        assert all(not r.block_table for r in self.live.values()
                   if r.status is RequestStatus.WAITING)

    def teardown(self):
        for req in list(self.live.values()):
            self.kv.free(req)
        self.live.clear()
        self.kv.take_copies()
        assert self.kv.check([]) == []
        assert self.kv.pool.num_free == self.kv.pool.num_blocks, "blocks leaked"


def _needs_chunk(m: KVMachine):
    return lambda r: (r.status is RequestStatus.RUNNING and r.request_id not in m.scheduled
                      and r.num_computed_tokens < r.num_tokens)


def _can_decode(m: KVMachine):
    return lambda r: (r.status is RequestStatus.RUNNING and r.request_id not in m.scheduled
                      and r.num_computed_tokens == r.num_tokens)


KVMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                       suppress_health_check=list(HealthCheck))
test_kv_cache_under_random_operations = KVMachine.TestCase
