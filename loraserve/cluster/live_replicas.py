"""Which engine replicas are live, as the ingress's own router sees them.

Ray ships a request router class to the process that routes (pickled by value, module and
all), so the router cannot keep process state in its own module: it registers itself here
when Ray initialises it, and the ingress reads the replica set from it.
"""

from __future__ import annotations

import asyncio
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


async def is_alive(app_name: str, deployment: str, rid: str, timeout_s: float = 2.0) -> bool:
    """Whether replica `rid`'s actor still answers, asked directly (a routed call to a dead
    replica waits for it instead of failing until Serve notices the death)."""
    import ray
    from ray.exceptions import RayActorError

    def lookup():
        return ray.get_actor(f"SERVE_REPLICA::{app_name}#{deployment}#{rid}", namespace="serve")

    try:
        actor = await asyncio.get_running_loop().run_in_executor(None, lookup)
        await asyncio.wait_for(_ready(actor), timeout_s)
        return True
    except (ValueError, RayActorError):  # no such actor, or it died
        return False
    except TimeoutError:  # alive but busy: not dead
        return True


async def _ready(actor):
    return await actor.__ray_ready__.remote()
