"""The engine thread's side of AsyncEngine (engine/async_engine.py): apply the queued commands
between steps, run steps, and hand each output to its request's stream on the stream's event
loop. Only this thread touches the engine; a failed step ends the requests in flight with an
error and the loop goes on."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import traceback
from dataclasses import dataclass

from loraserve.engine import messages as M
from loraserve.engine.request_stream import Accepted, RequestStream
from loraserve.ops.openmp_team import WORKER_NICE, lower_worker_priority
from loraserve.types import FinishReason, RequestOutput

log = logging.getLogger("loraserve.engine")

STOP = object()  # ends the engine thread


@dataclass(frozen=True)
class Envelope:
    """A command and where its reply goes: a future, or a request's output queue."""

    cmd: M.EngineCommand
    loop: asyncio.AbstractEventLoop | None = None
    reply: asyncio.Future | asyncio.Queue | None = None


class EngineLoop:
    """Mixed into AsyncEngine: uses its engine, command queue (`_cmds`), open streams
    (`_streams`), poll intervals and error count."""

    def _run(self) -> None:
        engine = self.engine
        nice = int(os.environ.get("LORASERVE_WORKER_NICE", WORKER_NICE))
        if nice:  # the clients' threads first when they and the step's team want a core
            lower_worker_priority(nice)
        while True:
            idle = not engine.has_work
            # paused requests are not work, but their time limit must still be checked
            timeout = self._paused_poll_s if idle and engine.has_paused else None
            if not self._drain(block=idle, timeout=timeout):
                break
            if not engine.has_work:
                for out in engine.expire_stalled():
                    self._deliver(out)
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
            if item is STOP:
                return False
            self._apply(item)
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, env: Envelope) -> None:
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
            _put(env.loop, env.reply,
                 exc if exc is not None else Accepted(result.adapter_version))
        elif isinstance(cmd, M.AbortRequest):
            entry = self._streams.pop(cmd.request_id, None)
            if entry is not None and result is not None:
                _put(*entry, result)
        elif isinstance(cmd, M.PauseRequest | M.ResumeRequest):
            pass  # nobody awaits a reply: a request that ended meanwhile is simply not there
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


def _put(loop: asyncio.AbstractEventLoop, stream: RequestStream, item) -> None:
    try:
        loop.call_soon_threadsafe(stream._push, item)
    except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
        pass


def _resolve(fut: asyncio.Future, result, exc) -> None:
    if fut.done():  # the caller gave up (cancelled)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
