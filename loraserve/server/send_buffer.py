"""Bounded send buffers: a client that stops reading its stream is noticed within a bounded
number of bytes, so its request can leave the batch (engine/async_engine.py backpressure).

Between the response generator and the client sit the event loop transport's buffer and the
kernel's socket buffer, which on Linux grows by itself to megabytes: thousands of tokens of
server-sent events that a non-reading client would hold the engine for before the handler
ever blocked. Here both are capped per connection; a client that reads keeps its pace (the
cap is the data in flight, not a rate).
"""

from __future__ import annotations

import asyncio
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol


def bounded_h11_protocol(send_buffer_bytes: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with at most `send_buffer_bytes` buffered per connection, in
    the transport and in the socket's send buffer each."""

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
                except OSError:  # not a TCP socket (tests' in-memory transports)
                    pass
            transport.set_write_buffer_limits(high=send_buffer_bytes)

    return BoundedH11Protocol
