"""Bounded harm with the tiny model: a short request beside a long prompt finishes within its
own few steps with the tokens it would get alone; a paused request (its client not reading)
gives its KV back and resumes to the same tokens; through AsyncEngine, a stream nobody reads
pauses its request, reading resumes it, and one never read is ended after the time limit with
everything released."""

from __future__ import annotations

import asyncio
import time

from loraserve import LLM
from loraserve.config import EngineConfig
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.engine import LLMEngine
from loraserve.types import FinishReason, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 500 + 4 for i in range(n)]


def test_short_request_beside_a_long_prompt_is_not_held_behind_it(tiny_model_dir):
    solo = LLM(str(tiny_model_dir))
    long_p, short_p = prompt(480), prompt(9, 3)
    want_long = solo.generate([long_p], GREEDY)[0].token_ids
    want_short = solo.generate([short_p], GREEDY)[0].token_ids
    eng = LLMEngine(tiny_model_dir, EngineConfig(max_num_batched_tokens=64, kv_cache_tokens=4096,
                                                 enable_prefix_caching=False))
    long = eng.add_request(long_p, GREEDY, client_id="a")
    eng.step()  # the long prompt's first chunk
    short = eng.add_request(short_p, GREEDY, client_id="b")
    steps = 0
    while not short.is_finished:
        eng.step()
        steps += 1
    # its prefill, then one decode a step: the long prompt's chunks never delay it
    assert steps <= GREEDY.max_tokens + 1 and not long.is_finished
    assert short.output_token_ids == want_short
    while eng.has_work:
        eng.step()
    assert long.output_token_ids == want_long
    assert eng.check_invariants().ok


def test_paused_request_resumes_to_the_same_tokens(tiny_model_dir):
    want = LLM(str(tiny_model_dir)).generate([prompt(30)], GREEDY)[0].token_ids
    eng = LLMEngine(tiny_model_dir, EngineConfig(kv_cache_tokens=4096,
                                                 decode_steps_per_call=1))  # a step a token
    req = eng.add_request(prompt(30), GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.pause(req.request_id) and eng.has_paused and not eng.has_work
    assert req.block_table == [] and eng.kv.pool.num_used == 0 and eng.check_invariants().ok
    assert eng.resume(req.request_id)
    while eng.has_work:
        eng.step()
    assert req.output_token_ids == want and req.finish_reason is FinishReason.LENGTH


def _aengine(tiny_model_dir, **knobs) -> AsyncEngine:
    ae = AsyncEngine(LLMEngine(tiny_model_dir, EngineConfig(kv_cache_tokens=4096, **knobs)),
                     paused_poll_s=0.05)
    ae.start()
    return ae


async def _until(cond, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_unread_stream_pauses_its_request_and_reading_resumes_it(tiny_model_dir):
    # long enough that the event loop sends the pause before the request ends, even when a
    # loaded host runs the engine thread many steps ahead of it (the tiny model's context: 512)
    sp = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
    want = LLM(str(tiny_model_dir)).generate([prompt(12)], sp)[0].token_ids
    ae = _aengine(tiny_model_dir, max_unread_outputs=3)

    async def main():
        stream = await ae.add_request(prompt(12), sp, client_id="slow")

        async def paused():
            snap = await ae.snapshot()
            return snap.paused == 1 and snap.kv_blocks_used == 0

        await _until(paused)  # nobody reads: out of the batch, its KV given back
        steps = (await ae.snapshot()).num_steps
        await asyncio.sleep(0.2)
        assert (await ae.snapshot()).num_steps == steps  # and it costs no step
        outs = []
        async for out in stream:  # reading resumes it, as often as it fills up
            outs.append(out)
            await asyncio.sleep(0.002)
        out = outs[-1]
        assert out.token_ids == want and out.finish_reason is FinishReason.LENGTH
        assert (await ae.check_invariants()).ok

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()


def test_stream_never_read_is_ended_after_the_time_limit(tiny_model_dir):
    sp = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)  # as above
    ae = _aengine(tiny_model_dir, max_unread_outputs=2, stalled_stream_timeout=0.3)

    async def main():
        stream = await ae.add_request(prompt(12), sp)

        async def ended():
            snap = await ae.snapshot()
            return snap.running == snap.waiting == snap.paused == 0

        await _until(ended)
        outs = [o async for o in stream]
        assert outs[-1].finish_reason is FinishReason.ERROR and outs[-1].error_status == 408
        report = await ae.check_invariants()
        assert report.ok and report.kv_blocks_held == 0 and report.requests == 0

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
