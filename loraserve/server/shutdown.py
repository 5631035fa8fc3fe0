"""Graceful shutdown on SIGINT / SIGTERM, as serving users expect it.

The first signal stops admitting (new requests get a 503 with Retry-After) and gives the
requests in flight `--shutdown-timeout` seconds to finish; what still runs then ends with an
OpenAI-shaped 503 error (streams get an error event and `[DONE]`), the connections close, and
the process exits 0. uvicorn's own grace period is longer, so it never has to cancel a handler
mid-response. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType

import uvicorn

from loraserve.server.context import ServerContext
from loraserve.server.tenant_routes import reload_on_signal

# after the drain: time for the last responses to be written before uvicorn cancels anything
_WRITE_GRACE_S = 5


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext, shutdown_timeout_s: float):
        config.timeout_graceful_shutdown = int(shutdown_timeout_s) + _WRITE_GRACE_S
        super().__init__(config)
        self.ctx = ctx
        self.shutdown_timeout_s = shutdown_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        if self.ctx.keys.active:  # SIGHUP reloads the tenant keys (tenant_routes.py)
            self.loop.add_signal_handler(signal.SIGHUP, reload_on_signal, self.ctx)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self.ctx.begin_drain, self.shutdown_timeout_s)
        super().handle_exit(sig, frame)
        # a graceful, complete shutdown is a normal exit (status 0), not a re-raised signal
        if sig in (signal.SIGINT, signal.SIGTERM):
            self._captured_signals.clear()
