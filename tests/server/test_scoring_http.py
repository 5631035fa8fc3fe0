"""Prompt scoring over HTTP with the `openai` client: `prompt_logprobs` (vLLM's shape),
`max_tokens: 0`, `return_tokens_as_token_ids`, streamed and not, for the base model and an
adapter; the values equal transformers + PEFT's log-softmax."""

from __future__ import annotations

import pytest
from adapter_factory import build_peft_model, load_base_model
from lora_reference import prompt_logprobs as reference
from model_factory import make_tiny_llama
from server_utils import ServerProcess

PROMPT = [5, 77, 301, 12, 9, 44, 18, 250, 3, 61]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scoring_http")
    model = make_tiny_llama(root / "model")
    peft = build_peft_model(model, r=8, lora_alpha=16, seed=3, init_scale=1.0)
    peft.save_pretrained(root / "a1", safe_serialization=True)
    server = ServerProcess(model, "--lora-paths", f"a1={root / 'a1'}", log_dir=root)
    try:
        yield server.wait_ready(), {"model": load_base_model(model), "a1": peft.eval()}
    finally:
        server.stop()


def check(entries, ref, k):
    assert entries[0] is None and len(entries) == len(PROMPT)
    for token, entry, (lp, rank, top) in zip(PROMPT[1:], entries[1:], ref, strict=True):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(lp, abs=1e-4) and mine["rank"] == rank
        assert mine["decoded_token"] == f"token_id:{token}"
        for t, v in top[:k]:
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)


@pytest.mark.parametrize("model", ["model", "a1"])
def test_scoring_a_prompt_generates_nothing(setup, model):
    server, refs = setup
    r = server.openai().completions.create(
        model=model, prompt=PROMPT, max_tokens=0,
        extra_body={"prompt_logprobs": 2, "return_tokens_as_token_ids": True})
    choice = r.choices[0]
    assert choice.text == "" and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)
    check(choice.model_extra["prompt_logprobs"], reference(refs[model], PROMPT, 2), 2)


def test_streamed_prompt_logprobs_come_first_and_once(setup):
    server, refs = setup
    stream = server.openai().completions.create(
        model="a1", prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=1, stream=True,
        extra_body={"prompt_logprobs": 0, "return_tokens_as_token_ids": True,
                    "ignore_eos": True})
    chunks = [c.choices[0] for c in stream if c.choices]
    scored = [c.model_extra.get("prompt_logprobs") for c in chunks]
    assert scored[0] is not None and all(s is None for s in scored[1:])
    check(scored[0], reference(refs["a1"], PROMPT, 0), 0)
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert len(tokens) == 4 and all(t.startswith("token_id:") for t in tokens)


def test_bad_prompt_logprobs_is_a_400(setup):
    server, _ = setup
    r = server.post("/v1/completions", {"model": "model", "prompt": PROMPT,
                                        "prompt_logprobs": 50})
    assert r.status_code == 400 and "prompt_logprobs" in r.text
