"""Penalties, min_tokens, logit_bias and min_p, per request inside mixed batches.

The reference is `ref_process`, a plain per-token implementation of the documented formulas
(OpenAI's for presence/frequency and logit_bias, CTRL's repetition penalty as vLLM and
transformers apply it). It is itself checked against transformers' logits processors where
those exist. The engine's greedy outputs must equal a loop that recomputes the whole sequence
with the transformers (+ PEFT) model, applies `ref_process` and takes the argmax.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from adapter_factory import load_base_model
from lora_reference import LIFECYCLE_ADAPTERS, assert_idle, make_adapters

from loraserve import LLM, SamplingParams
from loraserve.model.logits_processors import apply_min_p, process_logits
from loraserve.model.sampler import sample
from loraserve.types import FinishReason

EOS = frozenset({1, 3})  # the tiny model's </s> and <|im_end|>
VOCAB = 512


def ref_process(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int],
                eos: frozenset[int] = EOS) -> list[float]:
    x = list(logits)
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = -math.inf
    if p.repetition_penalty != 1.0:
        r = p.repetition_penalty
        for t in set(prompt) | set(output):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def random_params(rng: random.Random, **fixed) -> SamplingParams:
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=rng.random() < 0.3)
    if rng.random() < 0.6:
        kw["repetition_penalty"] = rng.choice([0.7, 1.3, 2.0])
    if rng.random() < 0.6:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.5:
        kw["min_tokens"] = rng.randint(1, 6)
        kw["stop_token_ids"] = (rng.randrange(4, VOCAB),)
    if rng.random() < 0.5:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(3)}
    return SamplingParams(**{**kw, **fixed})


def test_processing_matches_the_reference_row_by_row():
    rng = random.Random(0)
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    params = [random_params(rng) for _ in range(15)] + [SamplingParams()]  # last: untouched
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in params]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))] for _ in params]
    outputs[0] = prompts[0][:3] * 3  # repeats, and tokens seen in both prompt and output
    got = process_logits(logits, params, prompts, outputs, EOS)
    for i, p in enumerate(params):
        want = torch.tensor(ref_process(logits[i].tolist(), p, prompts[i], outputs[i]))
        torch.testing.assert_close(got[i], want.float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(got[15], logits[15])
    plain = [SamplingParams()] * 16
    assert process_logits(logits, plain, prompts, outputs, EOS) is logits  # no copy at all


def test_the_reference_agrees_with_transformers_processors():
    from transformers.generation import logits_process as hf

    rng = random.Random(1)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    prompt = [rng.randrange(VOCAB) for _ in range(20)]
    output = [rng.randrange(VOCAB) for _ in range(5)]
    ids = torch.tensor([prompt + output])
    cases = [
        (SamplingParams(repetition_penalty=1.4), hf.RepetitionPenaltyLogitsProcessor(1.4)),
        (SamplingParams(repetition_penalty=0.6), hf.RepetitionPenaltyLogitsProcessor(0.6)),
        (SamplingParams(logit_bias={7: 5.0, 300: -20.0}),
         hf.SequenceBiasLogitsProcessor([[[7], 5.0], [[300], -20.0]])),
        (SamplingParams(min_tokens=8, max_tokens=16),
         hf.MinNewTokensLengthLogitsProcessor(len(prompt), 8, sorted(EOS))),
    ]
    for params, processor in cases:
        want = processor(ids, logits.clone())[0]
        got = torch.tensor(ref_process(logits[0].tolist(), params, prompt, output)).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for min_p in (0.01, 0.3, 1.0):
        want = hf.MinPLogitsWarper(min_p)(ids, logits.clone())[0]
        assert torch.equal(apply_min_p(logits[0], min_p).isinf(), want.isinf())


def test_min_p_samples_only_tokens_above_its_share_of_the_top():
    row = torch.randn(60, generator=torch.Generator().manual_seed(4))
    probs = row.softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    n = 600
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * n
    gen = torch.Generator().manual_seed(0)
    got = set(sample(row.expand(n, -1).clone(), params, [gen] * n).token_ids)
    assert got <= allowed and len(got) > 1


def hf_reference(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy loop on the whole sequence each step: logits -> ref_process -> argmax."""
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < p.max_tokens:
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            token = max(range(VOCAB), key=ref_process(logits.tolist(), p, prompt, out).__getitem__)
            out.append(token)
            if token in p.stop_token_ids or (not p.ignore_eos and token in EOS):
                break
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    specs = {k: LIFECYCLE_ADAPTERS[k] for k in ("a", "c")}
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("penalty_loras"), specs)


def test_mixed_batch_greedy_equals_the_reference(tiny_model_dir, adapters):
    from peft import PeftModel

    rng = random.Random(2)
    reqs = []
    for i in range(12):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 30))]
        bias = {1: 6.0} if i % 4 == 0 else {}  # EOS likely: min_tokens has work to do
        p = random_params(rng, ignore_eos=False, logit_bias=bias) if i % 3 else \
            SamplingParams(max_tokens=12, temperature=0.0)
        reqs.append((prompt, p, [None, "a", "c"][i % 3]))
    llm = LLM(str(tiny_model_dir), lora_paths={k: str(v) for k, v in adapters.items()},
              max_loras_per_batch=2, max_num_batched_tokens=48)
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs], lora=[r[2] for r in reqs])
    assert_idle(llm.engine)
    base = load_base_model(tiny_model_dir)
    models = {None: base}
    for name, path in adapters.items():
        models[name] = PeftModel.from_pretrained(load_base_model(tiny_model_dir), path)
    stopped_early = 0
    for (prompt, p, lora), out in zip(reqs, outs, strict=True):
        want = hf_reference(models[lora], prompt, p)
        assert out.token_ids == want, (p, lora)
        assert len(out.token_ids) > p.min_tokens or len(out.token_ids) == p.max_tokens
        stopped_early += out.finish_reason is FinishReason.STOP
    assert stopped_early  # EOS after min_tokens happened somewhere, so the mask was exercised


def test_each_request_samples_the_same_alone_and_in_a_mixed_batch(tiny_model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 20))] for _ in range(8)]
    params = [random_params(rng, temperature=0.9, seed=100 + i, min_p=0.05 * (i % 3))
              for i in range(8)]
    llm = LLM(str(tiny_model_dir))
    alone = [llm.generate([pr], pa)[0].token_ids for pr, pa in zip(prompts, params, strict=True)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone


def test_min_tokens_also_holds_back_stop_strings(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    prompt = [5, 77, 301, 12, 9]
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                  ignore_eos=True))[0]
    first = llm.engine.tokenizer.decode(free.token_ids[:1])
    assert first.strip()
    cut = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                stop=[first]))[0]
    assert cut.text == "" and cut.finish_reason is FinishReason.STOP
    held = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                 stop=[first], min_tokens=3))[0]
    assert len(held.token_ids) >= 3 and held.text.startswith(first)


def test_out_of_range_values_are_refused_by_name():
    for kw, name in [({"repetition_penalty": 0.0}, "repetition_penalty"),
                     ({"repetition_penalty": 2.5}, "repetition_penalty"),
                     ({"presence_penalty": 2.1}, "presence_penalty"),
                     ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                     ({"min_p": 1.5}, "min_p"), ({"min_tokens": 20}, "min_tokens"),
                     ({"logit_bias": {5: 101}}, "logit_bias"),
                     ({"logit_bias": {-1: 1}}, "logit_bias")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(max_tokens=16, **kw)
    assert SamplingParams(logit_bias={9: 1, 2: -1}).logit_bias == ((2, -1.0), (9, 1.0))
