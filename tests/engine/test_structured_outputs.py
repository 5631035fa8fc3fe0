"""Structured outputs per request inside mixed-adapter batches: every output satisfies its
constraint at temperature 1.0 whatever its other sampling fields, under the `torch` and `cpu`
LoRA backends; a constraint that does not bind changes no greedy token; a row its grammar
leaves without a token ends with a clear reason; bad constraints are refused by name."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest
import torch
from lora_reference import assert_idle, make_adapters

import loraserve.demo
from loraserve import LLM, SamplingParams
from loraserve.model.structured import GrammarError
from loraserve.model.structured.mask import PendingMask
from loraserve.types import FinishReason, StructuredOutput

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tag"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tag": {"enum": ["red", "green", "blue"]},
                         "ok": {"type": "boolean"}}}
LIST = {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99},
        "minItems": 1, "maxItems": 4}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so", "a \"quoted\" one"]
LARK = 'start: "sum(" num ("," num)* ")"\nnum: /[1-9][0-9]?/\n'


def json_spec(schema) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema))


CONSTRAINTS = [
    (json_spec(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
    (StructuredOutput("regex", REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    (StructuredOutput("choice", json.dumps(CHOICES)), lambda t: t in CHOICES or pytest.fail(t)),
    (json_spec(LIST), lambda t: jsonschema.validate(json.loads(t), LIST)),
    (StructuredOutput("grammar", LARK),
     lambda t: re.fullmatch(r"sum\([1-9][0-9]?(,[1-9][0-9]?)*\)", t) or pytest.fail(t)),
    # unbounded (any keys, any length): it may also end by max_tokens
    (json_spec({"type": "object"}), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
]
UNBOUNDED = CONSTRAINTS[-1][0]
SAMPLING = [dict(), dict(top_p=0.9), dict(top_k=20), dict(min_p=0.05),
            dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
            dict(logit_bias={7: 4.0, 40: -50.0}), dict(min_tokens=2), dict(ignore_eos=True),
            dict(logprobs=2, top_k=50, top_p=0.8)]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    specs = {"a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=1),
             "c": dict(r=16, lora_alpha=16, target_modules=["q_proj", "down_proj"], seed=3,
                       init_scale=1.0)}
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("so_adapters"), specs)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_output_satisfies_its_constraint_in_mixed_batches(tiny_model_dir, adapters,
                                                                backend):
    llm = LLM(str(tiny_model_dir), lora_paths={k: str(v) for k, v in adapters.items()},
              lora_backend=backend, kv_cache_tokens=8192)
    prompts, params, loras, checks = [], [], [], []
    for i in range(36):
        spec, check = CONSTRAINTS[i % len(CONSTRAINTS)]
        extra = SAMPLING[i % len(SAMPLING)]
        prompts.append([5 + i, 77, 301, 12 + i, 9])
        params.append(SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                                     structured_outputs=spec, **extra))
        loras.append([None, "a", "c"][i % 3])
        checks.append(check)
    # unconstrained rows share the batches too
    prompts += [[31, 17, 480], [400, 23]]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=99)] * 2
    loras += ["a", None]
    outs = llm.generate(prompts, params, lora=loras)
    for out, p, check in zip(outs, params, checks, strict=False):
        if p.structured_outputs is UNBOUNDED and out.finish_reason is FinishReason.LENGTH:
            assert out.text.startswith("{")
            continue
        assert out.finish_reason is FinishReason.STOP, (out.text, out.finish_reason)
        check(out.text)
    assert_idle(llm.engine)


def test_constraint_that_does_not_bind_changes_no_greedy_token(bundled_model_dir):
    # A real model (valid UTF-8 text) with two demo adapters and the base in one batch.
    demo = Path(loraserve.demo.__file__).parent / "data"
    llm = LLM(str(bundled_model_dir), lora_paths={n: str(demo / n) for n in ("pirate", "french")},
              kv_cache_tokens=4096)
    chats = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France?", "Name a colour.", "Say hello.")]
    loras = [None, "pirate", "french"]
    free = llm.chat(chats, SamplingParams(max_tokens=12, temperature=0.0), lora=loras)
    # constraints each unconstrained output satisfies: its own text among other choices, any
    # text, and a regex of its characters
    params = [SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutput(
        "choice", json.dumps([o.text, "zz" + o.text]))) for o in free]
    params += [SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutput(
        "regex", r"(?s:.*)"))] * 3
    bound = llm.chat(chats + chats, params, lora=loras + loras)
    for f, b in zip(free + free, bound, strict=True):
        assert b.token_ids == f.token_ids and b.text == f.text


def test_n_choices_and_prefix_cache_keep_their_own_grammar_state(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    spec = StructuredOutput("regex", REGEX)
    prompt = list(range(5, 45))  # two full blocks: the second request reuses the first's K/V
    outs = llm.generate([prompt] * 4, [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                                      structured_outputs=spec)
                                       for s in range(4)])
    assert all(re.fullmatch(REGEX, o.text) for o in outs), [o.text for o in outs]
    again = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=0,
                                                  structured_outputs=spec))
    assert again[0].num_cached_tokens > 0 and again[0].text == outs[0].text


def test_preempted_constrained_requests_resume_their_grammar(tiny_model_dir):
    # A KV cache too small for all of them at once: some are preempted and recomputed.
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=256, block_size=16)
    spec = json_spec(LIST)
    outs = llm.generate([[5 + i, 9, 77] for i in range(8)],
                        [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                        structured_outputs=spec) for i in range(8)])
    for o in outs:
        jsonschema.validate(json.loads(o.text), LIST)
    assert_idle(llm.engine)


def test_grammar_complete_before_min_tokens_stops_not_nan(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    p = SamplingParams(max_tokens=10, temperature=1.0, min_tokens=8,
                       structured_outputs=StructuredOutput("choice", '["yes"]'))
    out = llm.generate([[5, 6, 7]], p)[0]
    assert out.text == "yes" and out.finish_reason is FinishReason.STOP


def test_row_left_without_an_allowed_token_ends_with_grammar_dead_end(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    # the grammar's first token is a stop id, masked while the output is below min_tokens
    p = SamplingParams(max_tokens=10, temperature=1.0, min_tokens=3, stop_token_ids=(200,),
                       structured_outputs=StructuredOutput("grammar", "start: <[200]> \"a\""))
    other = SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    out, neighbour = llm.generate([[5, 6, 7], [8, 9]], [p, other])
    assert out.finish_reason is FinishReason.GRAMMAR_DEAD_END and out.token_ids == []
    assert neighbour.finish_reason is FinishReason.LENGTH and len(neighbour.token_ids) == 5
    assert_idle(llm.engine)


@pytest.mark.parametrize("spec, why", [
    (StructuredOutput("json", "{not json"), "not valid JSON"),
    (json_spec({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (json_spec({"type": "strnig"}), "strnig"),
    (StructuredOutput("regex", "([a-z]"), "regex"),
    (StructuredOutput("grammar", "start: nothere"), "nothere"),
    (StructuredOutput("choice", "[]"), "choice"),
])
def test_constraint_that_cannot_compile_is_refused_naming_why(tiny_model_dir, spec, why):
    llm = LLM(str(tiny_model_dir))
    with pytest.raises(GrammarError, match=re.escape(why)) as e:
        llm.generate([[5, 6]], SamplingParams(structured_outputs=spec))
    assert e.value.status == 400
    assert_idle(llm.engine)


def test_grammars_are_cached_by_spec(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    spec = json_spec(PERSON)
    first = llm.engine.grammars.compile(spec)
    assert llm.engine.grammars.compile(StructuredOutput("json", spec.spec)) is first
    assert first.new_matcher() is not first.new_matcher()


def test_mask_bits_map_to_tokens_in_order():
    bitmask = torch.zeros((2, 3), dtype=torch.int32)
    bitmask[0, 0] = 1 - 2**31  # bits 0 and 31 (int32): tokens 0 and 31
    bitmask[1, 2] = 1 << 3  # token 67
    done = Future()
    done.set_result(None)
    pending = PendingMask([0, 2], bitmask, done)
    logits = torch.zeros(3, 70)
    out = pending.apply(logits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 31]
    assert torch.isfinite(out[1]).all()  # unconstrained row untouched
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [67]
    assert torch.isfinite(logits).all()  # the caller's logits are left as they were


def test_a_mask_dropped_while_filling_is_harmless(tiny_model_dir):
    # a failed forward pass drops its PendingMask while the native fill may still be writing
    llm = LLM(str(tiny_model_dir))
    grammar = llm.engine.grammars.compile(json_spec(PERSON))
    matchers = [grammar.new_matcher() for _ in range(32)]
    masker = llm.engine.runner.masker
    for _ in range(20):
        masker.start(matchers)  # dropped at once
    again = masker.start(matchers)
    allowed = again.allowed(masker.vocab_size, torch.device("cpu"))
    assert allowed.shape == (32, masker.vocab_size) and allowed.any(dim=-1).all()


def test_json_whitespace_is_bounded(tiny_model_dir):
    # one space after ',' and ':' only: no newline runs, no indentation, no double spaces
    llm = LLM(str(tiny_model_dir))
    grammar = llm.engine.grammars.compile(json_spec(PERSON))
    encode = llm.tokenizer.encode
    ok = grammar.new_matcher()
    assert ok.consume_tokens(encode('{"name": "ab", "age": 3, "tag": "red"}'))
    assert ok.is_accepting()
    for bad in ('{\n', '{ "name"', '{"name":  "a"', '{"name":"a"', '{"name": "a",\n'):
        m = grammar.new_matcher()
        assert not m.consume_tokens(encode(bad)), bad
