"""Which engine replicas are live, as the ingress's own router sees them.

Ray ships a request router class to the process that routes (pickled by value, module and
all), so the router cannot keep process state in its own module: it registers itself here
when Ray initialises it, and the ingress reads the replica set from it.
"""

from __future__ import annotations

import weakref

_ROUTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(app_name: str, deployment: str, router) -> None:
    _ROUTERS[(app_name, deployment)] = router


def replica_ids(app_name: str, deployment: str) -> list[str] | None:
    """The replicas the router of this process knows now (None: no router yet)."""
    router = _ROUTERS.get((app_name, deployment))
    if router is None:
        return None
    return sorted(r.replica_id.unique_id for r in router.curr_replicas.values())
