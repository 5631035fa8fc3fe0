"""Where the scheduler ends a prompt's chunks, where a prefix-cache hit ends, and which kernel
made a token's K/V change no bit of its request's output.

The step pace sizes chunks by measured step times, so the same request is chunked differently
from run to run. A prompt's token that came alone (the budget left one token, or only its last
was left) once ran as a decode, and the decode kernel summed attention scores in another order
than the prompt kernel: its logits moved by an ulp, and over quantized weights (activations
rounded to int8) that changed greedy tokens run to run. Every token of a prompt longer than one
is attended as a prompt token, and the decode kernel now sums a score as the prompt kernel
does, so a token's K/V made by either kernel are the same: a request recomputed after
preemption, and a prompt over cached blocks of another request's generated tokens, get the
bits of a run without either.
"""

from __future__ import annotations

import pytest
import torch
from model_factory import make_tiny_llama

from loraserve import LLM, SamplingParams
from loraserve.model.attention import cpu as cpu_attention
from loraserve.model.attention.base import AttentionSeq
from loraserve.ops.qgemm import load_qgemm

PROMPTS = [[(7 * i + 3) % 250 + 2 for i in range(39)], [(11 * i + 5) % 250 + 2 for i in range(39)]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("chunks") / "hf", hidden_size=128,
                           intermediate_size=256, initializer_range=0.3)


def _outputs(llm: LLM):
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, sp)
    assert all(o.error is None for o in outs)
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_a_prompt_gives_the_same_bits_however_it_was_chunked(tiny, scheme, monkeypatch):
    if scheme != "none" and load_qgemm() is None:
        pytest.skip("no quantized GEMM kernel on this host (gcc, AVX2)")
    whole = _outputs(LLM(str(tiny), quantization=scheme, enable_prefix_caching=False))
    seen: list[AttentionSeq] = []
    prepare = cpu_attention.CpuAttention.prepare

    def recording(self, seqs):
        seen.extend(seqs)
        return prepare(self, seqs)

    monkeypatch.setattr(cpu_attention.CpuAttention, "prepare", recording)
    # 20 tokens a step, no pace: the first prompt takes 20 then 19, the second its first
    # token alone beside them, then 19 and 19
    chunked = LLM(str(tiny), quantization=scheme, enable_prefix_caching=False,
                  max_num_batched_tokens=20, decode_pace_factor=0.0, pace_calibration=False)
    seen.clear()
    out = _outputs(chunked)
    assert any(s.num_new == 1 and s.prompt_chunk for s in seen), "no lone prompt token ran"
    assert out == whole


def test_a_lone_prompt_token_is_attended_as_a_prompt_and_a_decode_as_a_decode():
    attention = cpu_attention.CpuAttention(block_size=16, device="cpu")
    meta = attention.prepare([AttentionSeq(0, 1, 20, [0, 1], prompt_chunk=True),
                              AttentionSeq(1, 1, 30, [2, 3])])
    assert [(p.start, p.end) for p in meta.prefills] == [(0, 1)]
    assert meta.decode_rows.tolist() == [1]
    assert torch.equal(meta.decode_lens, torch.tensor([31]))


@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_a_prefix_cache_hit_that_leaves_one_prompt_token_gives_the_cold_bits(tiny, scheme):
    """17 tokens with a block of 16: the second time the cached block leaves the last prompt
    token to compute alone, as the prompt kernel computed it the first time."""
    if scheme != "none" and load_qgemm() is None:
        pytest.skip("no quantized GEMM kernel on this host (gcc, AVX2)")
    llm = LLM(str(tiny), quantization=scheme, block_size=16)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = PROMPTS[0][:17]
    cold = llm.generate([prompt], sp)[0]
    warm = llm.generate([prompt], sp)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 16
    assert (warm.token_ids, warm.logprobs) == (cold.token_ids, cold.logprobs)


@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_a_request_recomputed_after_preemption_gives_the_bits_of_one_never_preempted(tiny,
                                                                                     scheme):
    """Its generated tokens were decodes; after preemption they are recomputed as prompt rows."""
    if scheme != "none" and load_qgemm() is None:
        pytest.skip("no quantized GEMM kernel on this host (gcc, AVX2)")
    prompts = [p[:n] for p, n in zip(PROMPTS * 3, (14, 22, 9, 17, 30, 11), strict=True)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    alone = LLM(str(tiny), quantization=scheme, enable_prefix_caching=False)
    solo = [alone.generate([p], sp)[0] for p in prompts]
    small = LLM(str(tiny), quantization=scheme, enable_prefix_caching=False,
                kv_cache_tokens=64, block_size=4, max_num_batched_tokens=32)
    sched, preempted = small.engine.scheduler, []
    preempt = sched._preempt

    def counting(req, batch):
        preempted.append(req.request_id)
        preempt(req, batch)

    sched._preempt = counting
    outs = small.generate(prompts, sp)
    assert preempted, "no request was preempted"
    assert [(o.token_ids, o.logprobs) for o in outs] == [(o.token_ids, o.logprobs)
                                                         for o in solo]


@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_a_prompt_over_cached_generated_tokens_gives_the_cold_bits(tiny, scheme):
    """A multi-turn chat: the next turn's prompt holds the last turn's answer, whose blocks the
    prefix cache kept with their K/V as the decodes made them."""
    if scheme != "none" and load_qgemm() is None:
        pytest.skip("no quantized GEMM kernel on this host (gcc, AVX2)")
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(str(tiny), quantization=scheme, block_size=16)
    first = PROMPTS[0][:20]
    answer = llm.generate([first], SamplingParams(max_tokens=30, temperature=0.0,
                                                  ignore_eos=True))[0].token_ids
    turn = first + answer[:28] + PROMPTS[1][:3]  # 51 tokens: 3 whole blocks, 28 generated
    warm = llm.generate([turn], sp)[0]
    assert warm.num_cached_tokens == 48
    cold = LLM(str(tiny), quantization=scheme, enable_prefix_caching=False).generate([turn],
                                                                                     sp)[0]
    assert (warm.token_ids, warm.logprobs) == (cold.token_ids, cold.logprobs)
