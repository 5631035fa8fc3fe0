"""The adapter store's consistency report (DESIGN.md §3), for the engine's invariant check.

Pure: it reads the store, its slot pool, its disk loader and its residency policy through
their read-only views and changes nothing. Each problem is one sentence; an empty list means
every invariant holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from loraserve.adapters.eviction import pick_victim
from loraserve.adapters.store import AdapterStore


def check_store(store: AdapterStore, refs: Mapping[int, int], running: Set[int],
                waiting: list[int | None]) -> list[str]:
    """`refs`: uid -> live requests holding it (forks included); `running`: the adapters of
    running requests; `waiting`: each waiting request's adapter (None: base), in queue
    order."""
    problems: list[str] = []
    entries = store.entries
    for uid in set(refs) | set(running) | set(waiting) - {None}:
        if uid not in entries:
            problems.append(f"live requests use adapter uid {uid}, which the store freed")
    for uid, e in entries.items():
        if e.refcount != refs.get(uid, 0):
            problems.append(f"adapter {e.name} (uid {uid}): refcount {e.refcount}, "
                            f"{refs.get(uid, 0)} live requests")
        if e.unloading and e.refcount == 0:
            problems.append(f"adapter {e.name} (uid {uid}) drained but was never freed")
        if e.unloading and e.pinned:
            problems.append(f"adapter {e.name} (uid {uid}) is unloading but still pinned")
        if not e.unloading and store.live_versions(e.name).get(e.version) != uid:
            problems.append(f"adapter {e.name} (uid {uid}) is neither registered nor unloading")
        if e.slot is not None and e.weights is None:
            problems.append(f"adapter {e.name} holds slot {e.slot} without host weights")
        if uid in running and e.weights is None:
            problems.append(f"adapter {e.name} was evicted while its requests run")
    problems += store.residency.check()
    problems += _check_slots(store)
    problems += _check_caps(store)
    problems += store.loader.check(set(entries))
    problems += _check_progress(store, running, waiting)
    return problems


def _check_slots(store: AdapterStore) -> list[str]:
    problems = []
    seen: dict[int, int] = {}
    content = store.slots.content
    for uid, e in store.entries.items():
        if e.slot is None:
            continue
        if not 0 <= e.slot < store.slots.num_slots:
            problems.append(f"adapter {e.name} holds slot {e.slot}, out of range")
            continue
        if e.slot in seen:
            problems.append(f"slot {e.slot} is held by uids {seen[e.slot]} and {uid}")
        seen[e.slot] = uid
        if content[e.slot] != e.fingerprint:
            problems.append(f"slot {e.slot} holds other weights than its adapter {e.name}'s")
    return problems


def _check_caps(store: AdapterStore) -> list[str]:
    problems = []
    max_loaded = store.residency.limits.max_loaded_loras
    if max_loaded is not None:
        used = store.num_host + store.loader.num_pending
        if used > max_loaded:
            problems.append(f"{store.num_host} adapters in host memory and "
                            f"{store.loader.num_pending} loading: over max_loaded_loras="
                            f"{max_loaded}")
    limit = store.residency.pin_limit
    if not limit.allows(store.num_pinned):
        problems.append(f"{store.num_pinned} adapters pinned; {limit}")
    return problems


def _check_progress(store: AdapterStore, running: Set[int],
                    waiting: list[int | None]) -> list[str]:
    """Nothing waits on a load that no worker holds: when no request runs or can run (so
    none will end and free host room), a waiting adapter not in host memory must be
    loading, or the next `prepare` must be able to start its read."""
    if running or any(u is None or store.is_ready(u) for u in waiting):
        return []
    queue = list(dict.fromkeys(u for u in waiting if u in store.entries))
    window = queue[: store.residency.lookahead]
    cold = [u for u in window if not store.is_ready(u)]
    if not cold or any(store.loader.is_loading(u) for u in cold):
        return []
    # a read in flight lands soon: its adapter then runs or, unneeded, can be evicted
    max_loaded = store.residency.limits.max_loaded_loras
    has_room = (max_loaded is None or store.loader.num_pending > 0
                or store.num_host < max_loaded
                or pick_victim(store.host_entries(), set(window)) is not None)
    if has_room:
        return []
    names = [store.entries[u].name for u in cold]
    return [f"requests wait for adapters {names[:4]} that no worker loads and none can start"]
