"""The one eviction rule, for host memory and compute slots alike.

Never a pinned adapter, never one in `protected` (used by running or scheduled requests, or
about to be). Among the rest: adapters prefetched but not used since go first, then the least
recently used.
"""

from __future__ import annotations

from collections.abc import Iterable, Set

from loraserve.adapters.entry import AdapterEntry


def pick_victim(candidates: Iterable[AdapterEntry], protected: Set[int]) -> AdapterEntry | None:
    evictable = [e for e in candidates if not e.pinned and e.uid not in protected]
    return min(evictable, key=lambda e: (not e.prefetched, e.last_used), default=None)
