"""Graceful shutdown on SIGINT / SIGTERM, as serving users expect it.

The first signal starts the drain: the server keeps listening, every new request gets a 503
with Retry-After (drain.py), and the requests in flight have `--shutdown-timeout` seconds to
finish; what still runs then ends with an OpenAI-shaped 503 error (streams get an error event
and `[DONE]`). Once no request is left (or the drain and a grace period are over) uvicorn
stops listening, closes the connections, and the process exits 0. uvicorn's own grace period
is longer, so it never has to cancel a handler mid-response. A second SIGINT forces the exit.

`on_ready` runs once the sockets listen (after the app's start-up), so what it prints, such as
the demo's example commands, works when it appears.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from loraserve.server.context import ServerContext
from loraserve.server.tenant_routes import reload_on_signal

# after the drain: time for the last responses to be written before uvicorn cancels anything
_WRITE_GRACE_S = 5


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext, shutdown_timeout_s: float,
                 on_ready: Callable[[], None] | None = None):
        config.timeout_graceful_shutdown = int(shutdown_timeout_s) + _WRITE_GRACE_S
        super().__init__(config)
        self.ctx = ctx
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_ready = on_ready
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        if self.ctx.keys.active:  # SIGHUP reloads the tenant keys (tenant_routes.py)
            self.loop.add_signal_handler(signal.SIGHUP, reload_on_signal, self.ctx)
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_ready is not None:
            self.on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.loop is not None and not self._drain_started:
            self._drain_started = True  # uvicorn keeps serving until the drain is over
            self.loop.call_soon_threadsafe(self._start_drain)
        else:  # a second signal (or none of ours yet): uvicorn's own handling
            super().handle_exit(sig, frame)
        # a graceful, complete shutdown is a normal exit (status 0), not a re-raised signal
        if sig in (signal.SIGINT, signal.SIGTERM):
            self._captured_signals.clear()

    def _start_drain(self) -> None:
        self.ctx.begin_drain(self.shutdown_timeout_s)
        self._drain_task = asyncio.ensure_future(self._exit_when_drained())

    async def _exit_when_drained(self) -> None:
        """Stop serving once no request is in flight, at the latest when the drain and the
        time for the last answers to be written are over."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout_s + _WRITE_GRACE_S
        while self.ctx.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True
