"""One request's stream of outputs on the event loop's side of the engine thread.

Holds the request's bounded output queue: a reader that falls `max_unread` outputs behind
pauses its request (the engine gives back its seat and KV) and its next read resumes it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from loraserve.engine import messages as M
from loraserve.types import RequestOutput


class StreamOwner(Protocol):
    """What a stream asks of the engine's front (engine/async_engine.AsyncEngine)."""

    def _send(self, cmd: M.EngineCommand) -> None: ...

    def abort(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class Accepted:
    """First item of a stream when add_request succeeded."""

    adapter_version: int | None  # the adapter version the request is bound to



class RequestStream:
    """Outputs of one request. Iterating yields the latest RequestOutput (each carries the whole
    output so far, so a slow consumer skips intermediate ones). `abort()` is idempotent.
    With `max_unread` > 0, that many unread outputs pause the request until the next read."""

    def __init__(self, owner: StreamOwner, request_id: str, q: asyncio.Queue,
                 max_unread: int = 0):
        self.request_id = request_id
        self._owner = owner
        self._q = q
        self.max_unread = max_unread
        self.paused = False  # the engine was asked to pause it (event loop thread only)
        self.finished = False
        self.adapter_version: int | None = None  # set once admitted (adapter requests)

    def _push(self, item) -> None:
        """An item from the engine thread (event loop thread)."""
        self._q.put_nowait(item)
        if (self.max_unread and not self.paused and not self.finished
                and isinstance(item, RequestOutput) and not item.finished
                and self._q.qsize() >= self.max_unread):
            self.paused = True
            self._owner._send(M.PauseRequest(self.request_id))

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._q.get()
        while not self._q.empty():  # coalesce: only the newest state matters
            item = self._q.get_nowait()
        if self.paused:  # read: room again
            self.paused = False
            if not (isinstance(item, RequestOutput) and item.finished):
                self._owner._send(M.ResumeRequest(self.request_id))
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)
