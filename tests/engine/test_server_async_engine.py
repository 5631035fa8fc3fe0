"""AsyncEngine in-process: outputs match the engine's, errors reach the caller, cancelling
aborts at once, a failing step fails its requests but not the thread, and idle means idle."""

from __future__ import annotations

import asyncio

import pytest

from loraserve.config import EngineConfig
from loraserve.engine.async_engine import AsyncEngine
from loraserve.types import AdapterNotFoundError, FinishReason, RequestTooLargeError, SamplingParams


@pytest.fixture(scope="module")
def aengine(tiny_model_dir):
    from loraserve.engine.engine import LLMEngine

    ae = AsyncEngine(LLMEngine(tiny_model_dir, EngineConfig(kv_cache_tokens=4096)))
    ae.start()
    yield ae
    ae.shutdown()
    assert not ae.is_running


async def last(ae, prompt, params, lora=None):
    outs = [out async for out in ae.generate(prompt, params, lora)]
    return outs[-1]


def test_generate_and_errors(aengine, tiny_model_dir):
    from loraserve import LLM

    sp = SamplingParams(max_tokens=8, temperature=0.0)
    ref = LLM(tiny_model_dir).generate(["hello world", "the cat"], sp)

    async def main():
        outs = await asyncio.gather(last(aengine, "hello world", sp), last(aengine, "the cat", sp))
        assert [o.text for o in outs] == [r.text for r in ref]
        with pytest.raises(AdapterNotFoundError):
            await last(aengine, "hi", sp, lora="missing")
        with pytest.raises(RequestTooLargeError):
            await last(aengine, "", sp)

    asyncio.run(main())


def test_cancel_aborts_and_frees_blocks(aengine):
    sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        async def consume():
            async for _ in aengine.generate("hello", sp):
                pass

        task = asyncio.create_task(consume())
        while (await aengine.snapshot()).kv_blocks_used == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snap = await aengine.snapshot()  # the abort is ahead of this call
        assert snap.kv_blocks_used == 0 and snap.running == 0

    asyncio.run(main())


def test_step_failure_fails_requests_and_keeps_serving(aengine):
    # A failure outside the forward pass (here: the scheduler) fails the step's requests; one
    # inside it is contained to its request (tests/test_request_isolation.py).
    engine = aengine.engine
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(*a, **kw)

    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def main():
        engine.scheduler.schedule = flaky
        try:
            out = await last(aengine, "hello", sp)
        finally:
            engine.scheduler.schedule = real
        assert out.finish_reason is FinishReason.ERROR and "internal error" in out.error
        snap = await aengine.snapshot()
        assert snap.kv_blocks_used == 0
        ok = await last(aengine, "hello", sp)
        assert ok.finish_reason is FinishReason.LENGTH and len(ok.token_ids) == 20

    asyncio.run(main())
    assert aengine.errors == 1 and aengine.is_running


def test_idle_thread_does_not_spin(aengine):
    import time

    clock = time.pthread_getcpuclockid(aengine._thread.ident)
    t0 = time.clock_gettime(clock)
    time.sleep(0.5)
    assert time.clock_gettime(clock) - t0 < 0.02  # blocked on the command queue


def test_client_id_reaches_the_request(aengine):
    """The tenant that sent a request (the API key's name) is on the engine's Request."""
    sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        stream = await aengine.add_request("hello", sp, request_id="tenant-req",
                                           client_id="tenant-a")
        try:
            assert aengine.engine.requests["tenant-req"].client_id == "tenant-a"
        finally:
            stream.abort()
        stream = await aengine.add_request("hello", sp, request_id="anon-req")
        try:
            assert aengine.engine.requests["anon-req"].client_id is None
        finally:
            stream.abort()

    asyncio.run(main())


def test_cancel_loads_answers_a_stuck_admin_load_at_once(aengine, monkeypatch, tmp_path):
    """At the end of the drain a load still reading (a hung disk) gets a 503 at once."""
    import threading
    import time

    from loraserve.types import AdapterLoadCancelledError

    release = threading.Event()
    monkeypatch.setattr(aengine.engine, "read_adapter", lambda *a, **kw: release.wait(60))

    async def main():
        load = asyncio.create_task(aengine.load_lora_adapter("stuck", str(tmp_path)))
        await asyncio.sleep(0.2)
        assert not load.done()
        t0 = time.monotonic()
        aengine.cancel_loads()
        with pytest.raises(AdapterLoadCancelledError) as ei:
            await load
        assert ei.value.status == 503 and time.monotonic() - t0 < 5

    try:
        asyncio.run(main())
    finally:
        release.set()
        aengine._closing.clear()  # the module's engine serves the other tests
