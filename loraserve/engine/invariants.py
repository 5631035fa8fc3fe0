"""The engine's invariant check: a report collected from each component's own check.

Run between steps (any moment the engine thread is not inside `step()`): the scheduler checks
its queues, the KV cache manager its blocks against the live requests' tables (prefix hits and
forks share blocks, so a refcount is the number of live tables holding the block), the
adapter store its refcounts, slots, caps and loads. The engine adds what only it can see:
the requests it tracks are exactly the queued ones, and nothing keeps state for a request
that ended. Cheap enough (one pass over blocks and requests) for tests to call after every
operation and for operators to call on a live server (/debug/invariants).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from loraserve.adapters.store import AdapterStore
from loraserve.adapters.store_check import check_store
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request
from loraserve.scheduler.scheduler import Scheduler


class InvariantError(AssertionError):
    """An invariant check found problems: a bug in loraserve, never the client's fault."""


@dataclass(frozen=True)
class InvariantReport:
    violations: tuple[str, ...]
    requests: int  # live requests (running + waiting + paused)
    kv_blocks_held: int  # blocks some live request holds
    kv_blocks_cached: int  # blocks indexed by the prefix cache (held or free)
    kv_blocks_total: int
    adapters_registered: int
    adapters_draining: int  # unloaded, waiting for their last requests
    adapter_refs: int  # the sum of every adapter's refcount

    @property
    def ok(self) -> bool:
        return not self.violations

    def raise_if_failed(self) -> InvariantReport:
        if self.violations:
            raise InvariantError("engine invariants violated:\n  " +
                                 "\n  ".join(self.violations))
        return self

    def as_dict(self) -> dict:
        return {"ok": self.ok, "violations": list(self.violations), "requests": self.requests,
                "kv_blocks_held": self.kv_blocks_held,
                "kv_blocks_cached": self.kv_blocks_cached,
                "kv_blocks_total": self.kv_blocks_total,
                "adapters_registered": self.adapters_registered,
                "adapters_draining": self.adapters_draining, "adapter_refs": self.adapter_refs}


class Detokenizer(Protocol):
    def tracked_ids(self) -> Iterable[str]: ...


class EngineParts(Protocol):
    """What the check reads of an engine (engine/engine.LLMEngine), all of it read-only."""

    scheduler: Scheduler
    kv: KVCacheManager
    store: AdapterStore
    requests: Mapping[str, Request]  # every request the engine tracks, by id
    output_processor: Detokenizer


def check_engine(engine: EngineParts, awaited: Iterable[str] = ()) -> InvariantReport:
    """`awaited`: request ids someone still waits on outputs for (the server's streams);
    each must be a live request, or its client waits forever."""
    sched, store, kv = engine.scheduler, engine.store, engine.kv
    live = [*sched.running, *sched.waiting, *sched.paused.values()]
    ids = {r.request_id for r in live}
    problems = sched.check()
    lost = set(engine.requests) - ids
    if lost:
        problems.append(f"the engine tracks requests no queue holds: {sorted(lost)[:4]}")
    untracked = ids - set(engine.requests)
    if untracked:
        problems.append(f"queued requests the engine does not track: {sorted(untracked)[:4]}")
    stale = set(engine.output_processor.tracked_ids()) - ids
    if stale:
        problems.append(f"detokenizer state kept for ended requests: {sorted(stale)[:4]}")
    orphans = set(awaited) - ids
    if orphans:
        problems.append(f"clients wait on requests that ended: {sorted(orphans)[:4]}")
    for r in live:  # a parent that ended lets go of its forks (they keep their blocks)
        p = r.fork_parent
        if p is not None and not p.is_finished and r not in p.forks:
            problems.append(f"{r.request_id} forks from a parent that does not know it")
    problems += kv.check(live)
    refs = Counter(r.adapter_uid for r in live if r.adapter_uid is not None)
    problems += check_store(store, refs, sched.running_adapters(),
                            [r.adapter_uid for r in sched.waiting])
    entries = store.entries.values()
    return InvariantReport(
        violations=tuple(problems), requests=len(live),
        kv_blocks_held=kv.pool.num_used, kv_blocks_cached=kv.pool.num_cached,
        kv_blocks_total=kv.pool.num_blocks, adapters_registered=store.num_registered,
        adapters_draining=sum(1 for e in entries if e.unloading),
        adapter_refs=sum(e.refcount for e in entries))
