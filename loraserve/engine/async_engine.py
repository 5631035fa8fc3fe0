"""AsyncEngine: the engine loop on its own thread, driven from asyncio.

The engine thread is the only owner of the engine (scheduler, KV pool, adapter store). The
asyncio side talks to it through one thread-safe queue of typed commands (engine/messages.py)
and gets outputs back through a per-request asyncio queue (`loop.call_soon_threadsafe`).
Commands are applied between steps (engine/engine_loop.py), so no step ever sees a
half-changed store. Adapter files are read and validated on executor threads; only the commit
runs on the engine thread.

Backpressure: a request's output queue holds at most `max_unread_outputs` unread outputs.
When it is full (its client does not read, so the handler does not pull), the request is
paused: out of the running batch, its seat and KV given back. Reading resumes it; a request
paused for `stalled_stream_timeout` seconds is ended by the engine. The queue's state lives on
the event loop's thread only; the engine learns of it through Pause/Resume commands.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from loraserve.adapters.daemon_pool import DaemonPool
from loraserve.adapters.peft.budget import LoadBudget
from loraserve.adapters.spill import spill_dir
from loraserve.engine import messages as M
from loraserve.engine.engine_loop import STOP, EngineLoop, Envelope
from loraserve.engine.request_stream import RequestStream
from loraserve.types import AdapterLoadCancelledError, RequestOutput, SamplingParams


class AsyncEngine(EngineLoop):
    def __init__(self, engine: Any, idle_poll_s: float = 0.01, paused_poll_s: float = 0.5):
        # touched only by the engine thread (and tests); its read_adapter reads no engine state
        self.engine = engine
        self.info: M.EngineInfo = engine.info  # fixed for the engine's lifetime
        self.tokenizer = engine.tokenizer  # read-only: the server tokenizes on its own threads
        self.max_unread_outputs: int = engine.config.max_unread_outputs
        self.grammars = engine.grammars  # thread-safe: the server compiles on its own threads
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._idle_poll_s = idle_poll_s
        self._paused_poll_s = paused_poll_s  # how often paused requests' time limit is checked
        self._thread: threading.Thread | None = None
        self.errors = 0  # unexpected step failures survived (for tests and metrics)
        # admin loads: read on daemon threads, within a budget that shutdown cancels
        self._loads: DaemonPool | None = None
        self._closing = threading.Event()
        self._reads: set[asyncio.Future] = set()  # admin loads waiting for their read

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def cancel_loads(self) -> None:
        """End admin loads in progress with a 503 now (event loop thread); their reads stop
        at their next budget check, and no read holds the process at exit (daemon threads)."""
        self._closing.set()
        for read in list(self._reads):
            read.cancel()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.cancel_loads()
        if self._loads is not None:
            self._loads.shutdown()
        if self._thread is not None:
            self._cmds.put(STOP)
            self._thread.join(timeout)
            self._thread = None
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- requests ---------------------------------------------------------------------------
    async def add_request(self, prompt: M.Prompt, params: SamplingParams,
                          lora_name: str | None = None, request_id: str | None = None,
                          origin: str | None = None,
                          fork_of: str | None = None,
                          client_id: str | None = None, grammar=None) -> RequestStream:
        """Queue a request; raises what `engine.add_request` raised (LoraServeError: 4xx).
        `fork_of`: an earlier request with the same prompt and adapter (n > 1) whose
        computed prompt this one shares instead of computing it again. `grammar`:
        params.structured_outputs compiled already; else it is compiled here, on an executor
        thread (a request waits for its grammar, never the engine step)."""
        if params.structured_outputs is not None and grammar is None:
            grammar = await asyncio.get_running_loop().run_in_executor(
                None, self.grammars.compile, params.structured_outputs)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        q: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(self, rid, q, self.max_unread_outputs)
        cmd = M.AddRequest(rid, prompt, params, lora_name, origin, fork_of, client_id, grammar)
        self._cmds.put(Envelope(cmd, asyncio.get_running_loop(), stream))
        try:
            first = await q.get()
        except BaseException:
            stream.abort()  # cancelled while queued: the add is ahead of the abort in the queue
            raise
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        stream.adapter_version = first.adapter_version
        return stream

    async def generate(self, prompt: M.Prompt, params: SamplingParams,
                       lora_name: str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, lora_name, request_id)
        try:
            async for out in stream:
                yield out
        finally:  # cancelled or closed early (client gone): free its blocks now
            stream.abort()

    def abort(self, request_id: str) -> None:
        self._send(M.AbortRequest(request_id))

    def _send(self, cmd: M.EngineCommand) -> None:
        """A command whose reply nobody awaits."""
        self._cmds.put(Envelope(cmd))

    def abort_all(self, message: str, error_status: int = 503) -> None:
        """End every request in flight with an error (thread-safe, returns at once)."""
        self._cmds.put(Envelope(M.AbortAll(message, error_status)))

    # --- commands answered between steps ----------------------------------------------------
    async def _ask(self, cmd: M.EngineCommand) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(Envelope(cmd, loop, fut))
        return await fut

    async def snapshot(self) -> M.EngineSnapshot:
        return await self._ask(M.GetSnapshot())

    async def check_invariants(self):
        """The engine's InvariantReport, taken between steps; it also checks that every
        output stream still open belongs to a live request."""
        return await self._ask(M.CheckInvariants())

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False,
                                root: str | None = None, *, replace: bool = False,
                                version: int | None = None, owned: bool = False) -> int:
        """Validate off the engine thread, then commit between steps (the switch of a replace
        costs no step); a failure changes nothing. `root`: every file read must resolve
        inside it (--lora-root). `owned`: `path` is a spill copy, which the store keeps as the
        version's copy on disk, or which is removed here if the load fails. Returns the
        version now serving under `name`."""
        try:
            same = await self._ask(M.CheckAdapterLoad(name, path, pinned, replace))
            weights = None
            if not same:  # read + validate on a worker thread: decoding never stalls
                weights = await self._read(name, path, root)
            return await self._ask(M.LoadAdapter(name, path, pinned, weights, replace, version,
                                                 owned))
        except BaseException:
            if owned:
                spill_dir().remove(path)
            raise

    async def _read(self, name: str, path: str, root: str | None):
        """The adapter read on a daemon worker within a load budget that shutdown cancels."""
        reader = self.engine.read_adapter  # reads the model's weights only (DoRA's norms)
        if self._loads is None:
            self._loads = DaemonPool(2, "lora-admin-load")
        closing = self._closing
        read = asyncio.wrap_future(self._loads.submit(  # the budget starts with the read
            lambda: reader(path, root=root, budget=LoadBudget(cancelled=closing))))
        self._reads.add(read)
        try:
            return await read
        except asyncio.CancelledError:
            if not self._closing.is_set():
                raise  # the caller went away
            raise AdapterLoadCancelledError(
                f"adapter {name!r}: the load was cancelled (the server is shutting down); "
                "retry on another replica or later") from None
        finally:
            self._reads.discard(read)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._ask(M.UnloadAdapter(name))
