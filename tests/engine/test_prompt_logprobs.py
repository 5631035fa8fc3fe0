"""Prompt scoring (`prompt_logprobs`, `max_tokens=0`) equals transformers + PEFT.

For every prompt token after the first, its logprob under the model given the tokens before
it is PEFT's log-softmax of the same position's logits (float32, within 1e-4), for the base
model and for adapters, in one mixed batch, with chunked prefill and with the prefix cache
holding the same prompt already (scoring must compute it, not reuse K/V without logits).
"""

from __future__ import annotations

import pytest
from adapter_factory import build_peft_model, load_base_model
from lora_reference import prompt_logprobs as reference

from loraserve import LLM, SamplingParams
from loraserve.config import ATTN_MODULES, LORA_MODULES

ADAPTERS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=ATTN_MODULES, seed=21, init_scale=1.0),
    "all-r16": dict(r=16, lora_alpha=8, target_modules=LORA_MODULES, seed=22, init_scale=1.0),
}
PROMPTS = [[5, 77, 301, 12, 9, 44, 18, 250, 3], [400, 23, 8, 150, 66, 42, 7, 310, 99, 11, 2, 6],
           [260, 31]]


@pytest.fixture(scope="module")
def peft_models(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("scoring_adapters")
    models = {None: load_base_model(tiny_model_dir)}
    for name, spec in ADAPTERS.items():
        m = build_peft_model(tiny_model_dir, **spec)
        m.save_pretrained(root / name, safe_serialization=True)
        models[name] = m.eval()
    return root, models


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 8}])
def test_prompt_logprobs_equal_peft_in_a_mixed_batch(tiny_model_dir, peft_models, config):
    root, models = peft_models
    llm = LLM(model=tiny_model_dir, lora_paths={n: str(root / n) for n in ADAPTERS}, **config)
    names = [None, *ADAPTERS]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    # the same prompts generated first: their blocks are in the prefix cache when scored
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), lora=loras)
    params = [SamplingParams(max_tokens=0, prompt_logprobs=3), SamplingParams(
        max_tokens=3, temperature=0.0, prompt_logprobs=0, logprobs=1, ignore_eos=True)]
    outs = llm.generate(prompts * 2, [params[0]] * len(prompts) + [params[1]] * len(prompts),
                        lora=loras * 2)
    for i, out in enumerate(outs):
        prompt, name = prompts[i % len(prompts)], loras[i % len(prompts)]
        scoring_only = i < len(prompts)
        assert out.finished and out.error is None
        assert len(out.token_ids) == (0 if scoring_only else 3)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        ref = reference(models[name], prompt, 3)
        for got, (lp, rank, top) in zip(out.prompt_logprobs[1:], ref, strict=True):
            assert got.logprob == pytest.approx(lp, abs=1e-4)
            assert got.rank == rank
            if scoring_only:
                assert [t for t, _ in got.top] == [t for t, _ in top]
                assert [v for _, v in got.top] == pytest.approx([v for _, v in top], abs=1e-4)
            else:
                assert got.top == ()


def test_scoring_leaves_the_engine_idle(tiny_model_dir):
    llm = LLM(model=tiny_model_dir)
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert out.finish_reason == "length" and out.token_ids == [] and out.text == ""
    eng = llm.engine
    assert not eng.has_work and eng.kv.pool.num_free == eng.kv.pool.num_blocks
    eng.check_invariants().raise_if_failed()


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
