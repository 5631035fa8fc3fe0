"""AsyncEngine: the engine loop on its own thread, driven from asyncio.

The engine thread is the only owner of the engine (scheduler, KV pool, adapter store). The
asyncio side talks to it through one thread-safe queue of typed commands (engine/messages.py)
and gets outputs back through a per-request asyncio queue (`loop.call_soon_threadsafe`).
Commands are applied between steps, so no step ever sees a half-changed store. Adapter files
are read and validated on executor threads; only the commit runs on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from loraserve.adapters.format import read_adapter
from loraserve.engine import messages as M
from loraserve.types import FinishReason, RequestOutput, SamplingParams

log = logging.getLogger("loraserve.engine")

_ACCEPTED = object()  # first item of a stream when add_request succeeded
_STOP = object()  # ends the engine thread


@dataclass(frozen=True)
class _Envelope:
    """A command and where its reply goes: a future, or a request's output queue."""

    cmd: M.EngineCommand
    loop: asyncio.AbstractEventLoop | None = None
    reply: asyncio.Future | asyncio.Queue | None = None


class RequestStream:
    """Outputs of one request. Iterating yields the latest RequestOutput (each carries the whole
    output so far, so a slow consumer skips intermediate ones). `abort()` is idempotent."""

    def __init__(self, owner: AsyncEngine, request_id: str, q: asyncio.Queue):
        self.request_id = request_id
        self._owner = owner
        self._q = q
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._q.get()
        while not self._q.empty():  # coalesce: only the newest state matters
            item = self._q.get_nowait()
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


class AsyncEngine:
    def __init__(self, engine: Any, idle_poll_s: float = 0.01):
        self.engine = engine  # touched only by the engine thread (and tests)
        self.info: M.EngineInfo = engine.info  # fixed for the engine's lifetime
        self.tokenizer = engine.tokenizer  # read-only: the server tokenizes on its own threads
        self.grammars = engine.grammars  # thread-safe: the server compiles on its own threads
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._idle_poll_s = idle_poll_s
        self._thread: threading.Thread | None = None
        self.errors = 0  # unexpected step failures survived (for tests and metrics)

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._cmds.put(_STOP)
            self._thread.join(timeout)
            self._thread = None
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- requests ---------------------------------------------------------------------------
    async def add_request(self, prompt: M.Prompt, params: SamplingParams,
                          lora_name: str | None = None, request_id: str | None = None,
                          origin: str | None = None, fork_of: str | None = None,
                          grammar=None) -> RequestStream:
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
        stream = RequestStream(self, rid, q)
        cmd = M.AddRequest(rid, prompt, params, lora_name, origin, fork_of, grammar)
        self._cmds.put(_Envelope(cmd, asyncio.get_running_loop(), q))
        try:
            first = await q.get()
        except BaseException:
            stream.abort()  # cancelled while queued: the add is ahead of the abort in the queue
            raise
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
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
        self._cmds.put(_Envelope(M.AbortRequest(request_id)))

    def abort_all(self, message: str, error_status: int = 503) -> None:
        """End every request in flight with an error (thread-safe, returns at once)."""
        self._cmds.put(_Envelope(M.AbortAll(message, error_status)))

    # --- commands answered between steps ----------------------------------------------------
    async def _ask(self, cmd: M.EngineCommand) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(_Envelope(cmd, loop, fut))
        return await fut

    async def snapshot(self) -> M.EngineSnapshot:
        return await self._ask(M.GetSnapshot())

    async def check_invariants(self):
        """The engine's InvariantReport, taken between steps; it also checks that every
        output stream still open belongs to a live request."""
        return await self._ask(M.CheckInvariants())

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False,
                                root: str | None = None) -> None:
        """Validate off the engine thread, then commit between steps; a failure changes
        nothing. `root`: every file read must resolve inside it (--lora-root)."""
        same = await self._ask(M.CheckAdapterLoad(name, path, pinned))
        weights = None
        if not same:  # read + validate on an executor thread: decoding never stalls
            info = self.info
            weights = await asyncio.get_running_loop().run_in_executor(
                None, lambda: read_adapter(path, info.model_config,
                                           max_lora_rank=info.max_lora_rank,
                                           allow_pickle=info.allow_pickle_adapters,
                                           root=root))
        await self._ask(M.LoadAdapter(name, path, pinned, weights))

    async def unload_lora_adapter(self, name: str) -> None:
        await self._ask(M.UnloadAdapter(name))

    # --- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            if not self._drain(block=not engine.has_work):
                break
            if not engine.has_work:
                continue
            try:
                outputs = engine.step()
            except Exception:
                self._on_step_error()
                continue
            for out in outputs:
                self._deliver(out)
            if not outputs and not engine.has_running:
                # Nothing ran (e.g. waiting on an adapter load): wait a little for commands
                # instead of spinning.
                if not self._drain(block=True, timeout=self._idle_poll_s):
                    break
        self._fail_all("the server is shutting down", 503)

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands (waiting for the first if `block`). False on stop."""
        try:
            item = self._cmds.get(block=block, timeout=timeout)
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            self._apply(item)
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, env: _Envelope) -> None:
        cmd = env.cmd
        if isinstance(cmd, M.AbortAll):  # the streams are ours, not the engine's
            self._fail_all(cmd.message, cmd.error_status)
            return
        try:
            if isinstance(cmd, M.CheckInvariants):
                result, exc = self.engine.check_invariants(tuple(self._streams)), None
            else:
                result, exc = self.engine.handle(cmd), None
        except Exception as e:  # the caller's fault (LoraServeError) or a bad prompt
            if isinstance(cmd, M.AbortRequest):
                log.exception("abort of %s failed", cmd.request_id)
            result, exc = None, e
        if isinstance(cmd, M.AddRequest):
            if exc is None:
                self._streams[cmd.request_id] = (env.loop, env.reply)
            _put(env.loop, env.reply, exc if exc is not None else _ACCEPTED)
        elif isinstance(cmd, M.AbortRequest):
            entry = self._streams.pop(cmd.request_id, None)
            if entry is not None and result is not None:
                _put(*entry, result)
        else:
            env.loop.call_soon_threadsafe(_resolve, env.reply, result, exc)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        _put(*entry, out)

    def _on_step_error(self) -> None:
        # Keep serving: the requests of the failed step end with an error, their blocks and
        # adapter refcounts come back through abort (the one release path).
        self.errors += 1
        log.error("engine step failed; failing in-flight requests:\n%s", traceback.format_exc())
        self._fail_all("internal error in the engine step (see the server log)")

    def _fail_all(self, message: str, error_status: int = 500) -> None:
        for rid in list(self._streams):
            out = None
            try:
                out = self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            loop, q = self._streams.pop(rid)
            if out is None:
                out = RequestOutput(request_id=rid, prompt_token_ids=[], finished=True)
            out.finish_reason, out.error = FinishReason.ERROR, message
            out.error_status = error_status
            _put(loop, q, out)


def _put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
        pass


def _resolve(fut: asyncio.Future, result, exc) -> None:
    if fut.done():  # the caller gave up (cancelled)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
