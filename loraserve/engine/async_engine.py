"""AsyncEngine: the engine loop on its own thread, driven from asyncio.

The engine thread is the only owner of the engine (scheduler, KV pool, adapter store). The
asyncio side talks to it through one thread-safe command queue; outputs come back through a
per-request asyncio queue (`loop.call_soon_threadsafe`). Commands are applied between steps, so
no step ever sees a half-changed store. Adapter files are read and validated on executor
threads (`load_lora_adapter`), and only the commit runs on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from loraserve.types import FinishReason, RequestOutput, SamplingParams

log = logging.getLogger("loraserve.engine")

_ACCEPTED = object()  # first item of a stream when add_request succeeded
_STOP = ("stop",)


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
            self._owner._post(("abort", self.request_id))


class AsyncEngine:
    def __init__(self, engine: Any, idle_poll_s: float = 0.01):
        self.engine = engine
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
            self._post(_STOP)
            self._thread.join(timeout)
            self._thread = None
        loader = getattr(getattr(self.engine, "adapters", None), "loader", None)
        if loader is not None:
            loader.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _post(self, cmd: tuple) -> None:
        self._cmds.put(cmd)

    # --- requests ---------------------------------------------------------------------------
    async def add_request(self, prompt, params: SamplingParams, lora_name: str | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Queue a request; raises what `engine.add_request` raised (LoraServeError: 4xx)."""
        rid = request_id or f"req-{uuid.uuid4().hex}"
        q: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(self, rid, q)
        self._post(("add", rid, prompt, params, lora_name, asyncio.get_running_loop(), q))
        try:
            first = await q.get()
        except BaseException:
            stream.abort()  # cancelled while queued: the add is ahead of the abort in the queue
            raise
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        return stream

    async def generate(self, prompt, params: SamplingParams, lora_name: str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, lora_name, request_id)
        try:
            async for out in stream:
                yield out
        finally:  # cancelled or closed early (client gone): free its blocks now
            stream.abort()

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    # --- commands run on the engine thread between steps ------------------------------------
    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; its result or exception."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post(("call", fn, loop, fut))
        return await fut

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Validate off the engine thread, then commit between steps; a failure changes
        nothing."""
        same = await self.call(lambda e: e.adapters.check_new(name, path, pinned))
        weights = None
        if not same:  # read + validate on an executor thread: decoding never stalls
            loop = asyncio.get_running_loop()
            weights = await loop.run_in_executor(None, self.engine.read_adapter, path)
        await self.call(lambda e: e.load_lora_adapter(name, path, pinned, weights=weights))

    async def unload_lora_adapter(self, name: str) -> None:
        await self.call(lambda e: e.unload_lora_adapter(name))

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
            if not outputs and not engine.scheduler.running:
                # Nothing ran (e.g. waiting on an adapter load): wait a little for commands
                # instead of spinning.
                if not self._drain(block=True, timeout=self._idle_poll_s):
                    break
        self._fail_all("the server is shutting down")

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands (waiting for the first if `block`). False on stop."""
        try:
            cmd = self._cmds.get(block=block, timeout=timeout)
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            self._apply(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, lora_name, loop, q = cmd
            try:
                self.engine.add_request(prompt, params, lora_name=lora_name, request_id=rid)
            except Exception as e:  # the caller's fault (LoraServeError) or a bad prompt
                _put(loop, q, e)
                return
            self._streams[rid] = (loop, q)
            _put(loop, q, _ACCEPTED)
        elif kind == "abort":
            out = None
            try:
                out = self.engine.abort(cmd[1])
            except Exception:
                log.exception("abort of %s failed", cmd[1])
            entry = self._streams.pop(cmd[1], None)
            if entry is not None and out is not None:
                _put(*entry, out)
        elif kind == "call":
            _, fn, loop, fut = cmd
            try:
                result, exc = fn(self.engine), None
            except Exception as e:
                result, exc = None, e
            loop.call_soon_threadsafe(_resolve, fut, result, exc)

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

    def _fail_all(self, message: str) -> None:
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


def engine_snapshot(engine) -> dict:
    """A consistent view of the engine for /metrics, /v1/models and /debug/state. Runs on the
    engine thread (through `AsyncEngine.call`), so it never sees a half-done step."""
    pool, store = engine.kv.pool, engine.adapters
    adapters = []
    for e in store.entries.values() if store is not None else ():
        adapters.append({
            "name": e.name, "uid": e.uid, "path": e.path, "tier": e.tier, "pinned": e.pinned,
            "refcount": e.refcount, "registered": not e.unloading, "error": e.error,
            "rank": e.weights.rank if e.weights is not None else None,
            "stats": dict(vars(e.stats)),
        })
    return {
        "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
        "kv_blocks_used": pool.num_used, "kv_blocks_total": pool.num_blocks,
        "kv_usage": engine.kv.usage, "num_steps": engine.num_steps, "adapters": adapters,
    }
