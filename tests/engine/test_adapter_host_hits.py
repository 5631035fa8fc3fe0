"""The host-cache hit counter (benchmarks/scale_out.py reads it): a request counts a hit when its
adapter is in host memory as it arrives, and a miss when it must be read back from disk."""

from __future__ import annotations

import pytest
from lora_reference import make_adapters

from loraserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def ads(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("host_hits"))


@pytest.mark.parametrize("memory", ["unified", "tiered"])
def test_hits_count_arrivals_that_find_the_adapter_in_host_memory(tiny_model_dir, ads, memory):
    llm = LLM(str(tiny_model_dir), lora_memory=memory, max_loaded_loras=1,
              lora_paths={"a": ads["a"], "b": ads["b"]})  # b's load evicted a to disk
    store = llm.engine.store

    def stats(name):
        return store.entries[store.names[name]].stats

    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([[5, 6, 7]], params, lora="a")  # read back from disk: a miss
    llm.generate([[5, 6, 7]], params, lora="a")  # still resident: a hit
    assert (stats("a").requests, stats("a").host_hits) == (2, 1)
    llm.generate([[5, 6, 7]], params, lora="b")  # evicted by a's reload: a miss
    assert (stats("b").requests, stats("b").host_hits) == (1, 0)
    assert stats("a").loads == 2 and stats("b").loads == 2
