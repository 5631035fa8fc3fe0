"""The ingress's view of the engine replicas: who is there, and calls to one or to all.

Client requests go through Ray's router (affinity or round robin, routing.py). Control calls
(load, unload, /v1/models, /metrics) name their replica; the replicas are the ones the router
knows now. A replica that dies during a call is reported as gone (None), not as a failure of
the call: its replacement replays the registry when it starts. A call waiting on a replica
asks every second whether it is still alive, so a dead one never holds a load or an unload
for longer than that (Serve's router itself may take a minute to drop it); one alive that
does not answer in time is a 503 naming it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from loraserve.cluster import live_replicas
from loraserve.cluster.asgi_bridge import HttpReply, HttpRequest
from loraserve.cluster.registry import RegistryVersion
from loraserve.server.errors import error_bytes

log = logging.getLogger("loraserve.cluster")
_JSON = ((b"content-type", b"application/json"),)
_RETRY = (*_JSON, (b"retry-after", b"5"))
LIVENESS_POLL_S = 1.0


class Replicas:
    def __init__(self, handle, app_name: str, deployment: str, timeout_s: float):
        self.handle = handle
        self.app_name, self.deployment = app_name, deployment
        self.timeout_s = timeout_s

    def ids(self) -> list[str]:
        return live_replicas.replica_ids(self.app_name, self.deployment) or []

    async def wait_for_replicas(self, timeout_s: float = 60.0) -> list[str]:
        """The router learns the replica set asynchronously after its first call."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not (ids := self.ids()):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        return ids

    async def control(self, rid: str, req: HttpRequest,
                      want: RegistryVersion | None) -> HttpReply | None:
        # A fresh context: calls made inside a client request inherit its internal request
        # id, and Ray's router matches routed replicas to requests by that id, so concurrent
        # calls of one request (this fan-out) would all wait on the first one's match.
        response = contextvars.Context().run(self.handle.control.remote, req, want, target=rid)
        call = asyncio.ensure_future(_result(response))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=LIVENESS_POLL_S)
                if done:
                    return call.result()
                if rid not in self.ids() or not await live_replicas.is_alive(
                        self.app_name, self.deployment, rid):
                    log.warning("replica %s is gone (it stopped answering)", rid)
                    return None
                if loop.time() > deadline:
                    return HttpReply(503, _RETRY, error_bytes(
                        503, f"replica {rid} did not answer in {self.timeout_s:g} s; retry",
                        "server_unavailable"))
        except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
            log.warning("replica %s is gone (%s)", rid, type(e).__name__)
            return None
        finally:
            if not call.done():
                call.cancel()
                response.cancel()

    async def control_all(self, req: HttpRequest,
                          want: RegistryVersion | None) -> dict[str, HttpReply | None]:
        """Every live replica's answer (None: it went away meanwhile), by replica id."""
        ids = self.ids() or await self.wait_for_replicas()
        replies = await asyncio.gather(*(self.control(rid, req, want) for rid in ids))
        return dict(zip(ids, replies, strict=True))

    def stream(self, req: HttpRequest, want: RegistryVersion | None, adapter: str):
        """A client request, routed by adapter (the multiplexed model id)."""
        return self.handle.options(stream=True, multiplexed_model_id=adapter).handle_http \
            .remote(req, want, adapter)

    async def info(self) -> dict:
        return await self.handle.info.remote()


async def _result(response):
    return await response
