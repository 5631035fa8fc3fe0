"""Sampling: greedy, seeds, top-k/top-p, max_tokens, stop strings and ids, EOS, logprobs."""

from __future__ import annotations

import pytest
import torch

from loraserve import LLM, SamplingParams
from loraserve.model.sampler import argmax_rows, sample
from loraserve.types import FinishReason

EOS_IDS = (1, 3)  # tiny model: </s> and <|im_end|> (generation_config.json)



def prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 13 * i) % 500 + 4 for i in range(n)]


PROMPTS = ["the cat", "hello world", "SELECT name FROM", "red blue green"] + [
    prompt(n, n) for n in range(1, 29)
]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir))


@pytest.fixture(scope="module")
def full(llm):
    """Greedy continuations of PROMPTS that ignore EOS, to derive stops from."""
    return llm.generate(PROMPTS, greedy(ignore_eos=True))


# ---- the sampler alone -----------------------------------------------------------------------


def test_greedy_is_argmax_also_next_to_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [greedy()] * 6
    assert sample(logits, params, [None] * 6).token_ids == logits.argmax(-1).tolist()
    params[2] = SamplingParams(temperature=1.0, seed=1)
    gens = [None, None, torch.Generator().manual_seed(1), None, None, None]
    got = sample(logits, params, gens).token_ids
    assert [t for i, t in enumerate(got) if i != 2] == [
        t for i, t in enumerate(logits.argmax(-1).tolist()) if i != 2
    ]


def test_top_k_samples_only_the_k_most_likely():
    vocab, k, n = 40, 4, 800
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 0.5  # flat-ish
    top = set(torch.topk(row, k).indices.tolist())
    params = [SamplingParams(temperature=1.5, top_k=k)] * n
    gen = torch.Generator().manual_seed(0)
    got = sample(row.expand(n, vocab).clone(), params, [gen] * n).token_ids
    assert set(got) == top  # only those, and each of them shows up


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    n = 400
    gen = torch.Generator().manual_seed(0)
    got = sample(row.expand(n, 4).clone(), [SamplingParams(temperature=1.0, top_p=0.7)] * n,
                 [gen] * n).token_ids
    assert set(got) == {0, 1}
    got = sample(row.expand(n, 4).clone(), [SamplingParams(temperature=1.0, top_p=1e-6)] * n,
                 [gen] * n).token_ids
    assert set(got) == {0}


def test_sampler_logprobs():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    params = [greedy(logprobs=2), greedy(), greedy(logprobs=0)]
    res = sample(logits, params, [None] * 3)
    logp = logits.log_softmax(-1)
    assert res.logprobs == pytest.approx(logp.max(-1).values.tolist(), abs=1e-6)
    top = torch.topk(logp[0], 2)
    assert res.top_logprobs[0] == pytest.approx(dict(zip(top.indices.tolist(),
                                                         top.values.tolist(), strict=True)))
    assert res.top_logprobs[1] is None and res.top_logprobs[2] is None


# ---- through the engine ----------------------------------------------------------------------


SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)


def test_seed_is_reproducible_across_runs_and_batches(llm, tiny_model_dir):
    p = prompt(9, 7)
    alone = llm.generate([p], SEEDED)[0].token_ids
    assert llm.generate([p], SEEDED)[0].token_ids == alone
    others = [prompt(n, 3 * n) for n in (4, 30, 12, 1, 20)]
    mixed = others[:3] + [p] + others[3:]
    params = [greedy(ignore_eos=True), SamplingParams(temperature=1.0, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=42, top_k=20), SEEDED,
              SamplingParams(temperature=1.2, seed=7), greedy(max_tokens=3)]
    assert llm.generate(mixed, params)[3].token_ids == alone
    # Chunked prefill and preemption (recompute) must not change it either.
    small = LLM(str(tiny_model_dir), kv_cache_tokens=64, block_size=4,
                max_num_batched_tokens=8)
    preempted = []
    orig = small.engine.scheduler._preempt
    small.engine.scheduler._preempt = lambda r, b: (preempted.append(r), orig(r, b))
    assert small.generate(mixed, params)[3].token_ids == alone
    assert preempted
    other_seed = llm.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=43,
                                                  ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_1_and_tiny_top_p_equal_greedy(llm, full):
    prompts = PROMPTS[:6]
    ref = [o.token_ids for o in full[:6]]
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=1, **kw)
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(
        max_tokens=24, temperature=1.0, ignore_eos=True, seed=1))] != ref


def test_greedy_and_sampled_requests_in_one_batch(llm, full):
    sampled = llm.generate([PROMPTS[1]], SEEDED)[0].token_ids
    outs = llm.generate(PROMPTS[:2], [greedy(ignore_eos=True), SEEDED])
    assert outs[0].token_ids == full[0].token_ids
    assert outs[1].token_ids == sampled


def test_max_tokens(llm, full):
    out = llm.generate([PROMPTS[2]], greedy(max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason is FinishReason.LENGTH and out.finished
    assert out.token_ids == full[2].token_ids[:5]


def _pieces(llm, ids: list[int]) -> list[str | None]:
    """Each token's own text if it is plain ASCII letters/spaces, else None."""
    out = []
    for t in ids:
        s = llm.tokenizer.decode([t])
        out.append(s if s and all(c.isascii() and (c.isalpha() or c == " ") for c in s)
                   else None)
    return out


def _stop_cases(llm, full):
    """(prompt index, stop string, index of the token that completes it, spans two tokens)."""
    cases = {}
    for pi, out in enumerate(full):
        pieces = _pieces(llm, out.token_ids)
        for i in range(len(pieces) - 1):
            a, b = pieces[i], pieces[i + 1]
            if a and b and "span" not in cases:
                stop = a[-2:] + b[:2]
                if out.text.count(stop) == 1 and len(stop) >= 3:
                    cases["span"] = (pi, stop, i + 1)
            if a and len(a.strip()) >= 3 and "inside" not in cases:
                stop = a.strip()[:3]
                if out.text.count(stop) == 1:
                    cases["inside"] = (pi, stop, i)
    assert set(cases) == {"span", "inside"}, "no usable stop string in the outputs"
    return cases


def test_stop_strings(llm, full):
    for kind, (pi, stop, last) in _stop_cases(llm, full).items():
        text = full[pi].text
        out = llm.generate([PROMPTS[pi]], greedy(stop=[stop, "never-seen"]))[0]
        assert out.finish_reason is FinishReason.STOP, kind
        assert out.text == text[: text.index(stop)], kind  # cut before the stop string
        assert out.token_ids == full[pi].token_ids[: last + 1], kind
        assert out.holdback == 0


def test_stop_token_ids(llm, full):
    pi, j = next((pi, j) for pi, o in enumerate(full) if (ids := o.token_ids)
                 for j in range(3, len(ids)) if ids[j] not in ids[:j] + list(EOS_IDS)
                 and not llm.tokenizer.decode(ids[:j]).endswith("\ufffd"))
    ids = full[pi].token_ids
    out = llm.generate([PROMPTS[pi]], greedy(stop_token_ids=[ids[j]], ignore_eos=True))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == ids[: j + 1]  # the stop id is returned, its text is not
    head = llm.generate([PROMPTS[pi]], greedy(max_tokens=j, ignore_eos=True))[0].text
    assert out.text == head


def test_eos_stops_unless_ignore_eos(llm, full, tiny_model_dir):
    from test_reference_generate import hf_greedy

    pi, j = next((pi, ids.index(t)) for pi, o in enumerate(full) if (ids := o.token_ids)
                 for t in ids if t in EOS_IDS)
    out = llm.generate([PROMPTS[pi]], greedy())[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == full[pi].token_ids[: j + 1]  # ends with the EOS token
    ids = out.prompt_token_ids
    assert out.token_ids == hf_greedy(tiny_model_dir, ids, 24, ignore_eos=False)
    assert full[pi].finish_reason is FinishReason.LENGTH and len(full[pi].token_ids) == 24


def test_logprobs_match_hf(llm, tiny_model_dir):
    from test_reference_generate import hf_model

    model, _ = hf_model(tiny_model_dir)
    prompts = [prompt(n, n) for n in (3, 17, 40)]
    outs = llm.generate(prompts, greedy(max_tokens=8, ignore_eos=True, logprobs=3))
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p + out.token_ids])
        with torch.inference_mode():
            logp = model(ids).logits[0, len(p) - 1 : -1].log_softmax(-1)  # [8, V]
        want = logp.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
        assert out.logprobs == pytest.approx(want.tolist(), abs=1e-3)
        assert out.token_ids == logp.argmax(-1).tolist()
        for step, top in enumerate(out.top_logprobs):
            vals, idx = torch.topk(logp[step], 3)
            assert set(top) == set(idx.tolist())
            assert sorted(top.values()) == pytest.approx(sorted(vals.tolist()), abs=1e-3)
    plain = llm.generate(prompts[:1], greedy(max_tokens=4, ignore_eos=True))[0]
    assert plain.logprobs is None and plain.top_logprobs is None
    chosen = llm.generate(prompts[:1], greedy(max_tokens=4, ignore_eos=True, logprobs=0))[0]
    assert chosen.logprobs == pytest.approx(outs[0].logprobs[:4], abs=1e-5)
    assert chosen.top_logprobs is None


def test_argmax_rows_is_torch_argmax():
    """The CPU greedy pick goes through numpy: the same first maximum as torch.argmax, with
    ties, NaN (counted as the maximum) and rows of -inf, for a batch and for one row."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 5.0, nan, 1.0], [-inf] * 4,
                      [0.0, nan, 9.0, 9.0], [-1.0, -inf, inf, inf]])
    x = torch.cat([x, torch.randn(3, 4)])
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    for row in x:
        assert torch.equal(argmax_rows(row), row.argmax())
    wide = torch.randn(2, 49152)
    assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1))
