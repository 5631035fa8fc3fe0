"""Fair shares charge a token by what it costs: attending to its context grows with its
position, so a chunk deep in a long prompt is charged more than a short prompt's token
(fair_share.py, ModelConfig.attention_cost_per_position). Without it a long prompt's client
was charged a few tokens a step for the costliest steps of all, and a short request whose
client had been served a little more waited behind its chunks step after step."""

from __future__ import annotations

from dataclasses import replace

from test_fair_scheduling import creq
from test_scheduler import CheckedKV, step

from loraserve.config.engine import EngineConfig
from loraserve.config.model import ModelConfig
from loraserve.scheduler.fair_share import VirtualTokenCounter
from loraserve.scheduler.scheduler import Scheduler

SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "tie_word_embeddings": True, "architectures": ["LlamaForCausalLM"]}


def test_a_token_of_the_bundled_model_costs_twice_as_much_near_position_3900():
    # 30 layers x 2 x 9 heads x 64 against the 135M weights a token multiplies
    cost = ModelConfig.from_hf_dict(SMOLLM2).attention_cost_per_position
    assert 3800 < 1 / cost < 4000


def test_only_the_routed_experts_count_as_a_tokens_weights():
    dense = ModelConfig.from_hf_dict(SMOLLM2)
    moe = replace(dense, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768)
    all_experts = (moe.num_hidden_layers * 2 * moe.num_attention_heads * moe.head_dim
                   / moe.num_params)
    # two of eight experts multiply: the context is a larger part of a token's cost
    assert moe.attention_cost_per_position > 2 * all_experts


def test_deep_chunks_and_decodes_are_charged_for_their_context():
    vtc = VirtualTokenCounter(decode_weight=2.0, context_cost=1 / 4000)
    short, deep = creq("short", 64, "a"), creq("deep", 8000, "b")
    deep.num_computed_tokens = 6000
    vtc.charge(short, prefill_tokens=10)  # positions 0..9
    vtc.charge(deep, prefill_tokens=10)  # positions 6000..6009
    assert vtc.counter("a") == 10 * (1 + 4.5 / 4000)
    assert vtc.counter("b") == 10 * (1 + 6004.5 / 4000)
    vtc.charge(deep, decode_tokens=1)  # one decode at position 6000
    assert vtc.counter("b") == 10 * (1 + 6004.5 / 4000) + 2 * (1 + 6000 / 4000)


def _steps_until_admitted(context_cost: float) -> int:
    cfg = EngineConfig(kv_cache_tokens=16384, block_size=16, max_num_batched_tokens=64,
                       decode_pace_factor=0, enable_prefix_caching=False)
    s = Scheduler(cfg, CheckedKV(1024, 16, False), context_cost=context_cost)
    long = creq("long", 8000, "a")
    s.add(long)
    while long.num_computed_tokens < 6000:
        step(s)
    short = creq("short", 8, "b")
    s.add(short)
    # b was served before, a little more than a: its counter stays (no lift down)
    s.vtc.counters["b"] = s.vtc.counter("a") + 5 * 64
    for n in range(1, 20):
        if "short" in [r.request_id for r, _ in step(s).entries]:
            return n
    raise AssertionError("the short request never started")


def test_a_short_request_catches_up_with_a_long_prompts_client_by_cost_not_tokens():
    assert _steps_until_admitted(0.0) >= 5  # charged by tokens: 64 a step, 5 steps behind
    assert _steps_until_admitted(1 / 4000) <= 3  # each of those tokens costs 2.5
