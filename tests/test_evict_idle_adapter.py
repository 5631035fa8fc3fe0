"""Evicting an idle adapter on request (a cluster replica asks when Ray's multiplex cache
forgets it, issue 17): through the engine's command queue, in both adapter memories, the store
keeps an adapter a request holds or that is pinned, drops an idle one to disk (still
registered), and its next request reads it back and computes the same tokens."""

from __future__ import annotations

import asyncio

import pytest
from lora_reference import make_adapters

from loraserve.config import EngineConfig
from loraserve.engine.async_engine import AsyncEngine
from loraserve.types import AdapterNotFoundError, SamplingParams


@pytest.fixture(scope="module")
def ads(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("evict_idle"))


def tier(snap, name):
    return next(a.tier for a in snap.adapters if a.name == name and a.registered)


@pytest.mark.parametrize("memory", ["unified", "tiered"])
def test_evict_idle_adapter_through_the_engine(tiny_model_dir, ads, memory):
    from loraserve.engine.engine import LLMEngine

    config = EngineConfig(kv_cache_tokens=2048, lora_memory=memory, max_loaded_loras=4)
    ae = AsyncEngine(LLMEngine(tiny_model_dir, config))
    ae.start()
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def main():
        await ae.load_lora_adapter("a", ads["a"])
        await ae.load_lora_adapter("b", ads["b"])
        first = [o async for o in ae.generate([5, 6, 7], short, "a")][-1]
        stream = ae.generate([9, 8, 7], long, "b")
        await stream.__anext__()  # b is held by a running request
        assert await ae.evict_idle_adapter("b") is False
        await ae.load_lora_adapter("a", ads["a"], pinned=True)
        assert await ae.evict_idle_adapter("a") is False  # pinned
        assert tier(await ae.snapshot(), "a") != "disk"
        async for _ in stream:
            pass
        assert await ae.evict_idle_adapter("b") is True
        assert tier(await ae.snapshot(), "b") == "disk"
        with pytest.raises(AdapterNotFoundError):
            await ae.evict_idle_adapter("missing")
        await ae.unload_lora_adapter("a")
        await ae.load_lora_adapter("a", ads["a"])  # unpinned, resident again
        assert await ae.evict_idle_adapter("a") is True
        again = [o async for o in ae.generate([5, 6, 7], short, "a")][-1]
        assert again.token_ids == first.token_ids  # read back from disk, same weights
        assert tier(await ae.snapshot(), "a") != "disk"
        (await ae.check_invariants()).raise_if_failed()

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
