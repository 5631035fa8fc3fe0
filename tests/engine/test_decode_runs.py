"""Runs of decode steps in one call (scheduler/decode_runs.py, NativeDecode.greedy): a greedy
batch with nothing waiting takes several tokens a request per call into the native decode
loop, and nobody can tell from the answers.

- the tokens, texts and finish reasons equal those of one step a call, over float32, int8
  and int4 weights, with one thread and in one OpenMP team of two;
- a request that ends inside a run (a stop id, a stop string, its max_tokens) ends where it
  would have, and the others in the run go on;
- K/V written by a run is what later requests read from the prefix cache: a multi-turn
  prompt over a run's tokens gets the answer of an engine without the cache;
- rows of adapters (plain LoRA over quantized weights) and base rows in one run get the
  tokens of one step a call;
- in a team of two, whose threads take the first maximum of a half of the logits each, ties
  go to the first column and a NaN is the maximum, as numpy's argmax has it;
- after runs every block and refcount is accounted for (the engine's invariants);
- requests that want more than the first maximum (sampling, logprobs), adapters the C loop
  does not run (over float32 panels), and batches with anything waiting, take one step a
  call.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from adapter_factory import tiny_llama_with_adapter

from loraserve import LLM, SamplingParams
from loraserve.model.native_decode import NativeDecode
from loraserve.ops.qgemm import load_qgemm

pytestmark = pytest.mark.skipif(load_qgemm() is None,
                                reason="no quantized GEMM kernel on this host (gcc, AVX2)")

PROMPTS = [[5, 9, 13, 200, 17, 3, 44], [7, 8], [300, 301, 302, 303, 304, 305, 306, 307, 308,
                                               309, 310, 311, 312, 313, 314, 315, 316, 317]]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_with_adapter(tmp_path_factory.mktemp("runs"))


def _runs(monkeypatch) -> list[int]:
    """The steps of every run taken from now on."""
    steps: list[int] = []
    greedy = NativeDecode.greedy

    def counted(self, ids, computed, tables, k, *args):
        steps.append(k)
        return greedy(self, ids, computed, tables, k, *args)

    monkeypatch.setattr(NativeDecode, "greedy", counted)
    return steps


def _answers(outs):
    assert all(o.error is None for o in outs)
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def _pair(hf, scheme: str, **kw) -> tuple[LLM, LLM]:
    """One step a call, and runs of up to 8."""
    return tuple(LLM(str(hf), quantization=scheme, decode_steps_per_call=k, **kw) for k in (1, 8))


@pytest.mark.parametrize(("scheme", "threads"), [("none", 1), ("int8", 1), ("int4", 1),
                                                 ("int4", 2), ("none", 2)])
def test_runs_give_the_tokens_of_one_step_a_call(tiny, scheme, threads, monkeypatch):
    hf, _ = tiny
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain, runs = _pair(hf, scheme)
        steps = _runs(monkeypatch)
        want = _answers(plain.generate(PROMPTS, GREEDY))
        assert steps == []  # decode_steps_per_call=1 never runs
        assert _answers(runs.generate(PROMPTS, GREEDY)) == want
        assert steps and max(steps) > 1
        assert sum(steps) < 3 * 19  # fewer calls than tokens: most came in runs
    finally:
        torch.set_num_threads(before)


def _first_new(tokens: list[int], start: int) -> int:
    """An index from `start` whose token does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_requests_ending_inside_a_run_end_where_they_would(tiny, monkeypatch):
    hf, _ = tiny
    plain, runs = _pair(hf, "int8")
    free = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    stop_at = _first_new(free[0], 5)
    text = plain.generate([PROMPTS[1]], GREEDY)[0].text
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[free[0][stop_at]]),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                             stop=[text[len(text) // 2:len(text) // 2 + 3]]),
              SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)]
    want = _answers(plain.generate(PROMPTS, params))
    steps = _runs(monkeypatch)
    got = _answers(runs.generate(PROMPTS, params))
    assert got == want and max(steps) > 1
    assert [len(t) for t, _, _ in got][0] == stop_at + 1 and got[0][2] == "stop"
    assert got[1][2] == "stop" and len(got[2][0]) == 11
    runs.engine.check_invariants().raise_if_failed()
    pool = runs.engine.kv.pool
    assert pool.num_used == 0


def test_a_runs_kv_serves_the_prefix_cache(tiny, monkeypatch):
    hf, _ = tiny
    runs = LLM(str(hf), quantization="int4", decode_steps_per_call=8, block_size=4)
    fresh = LLM(str(hf), quantization="int4", decode_steps_per_call=1,
                enable_prefix_caching=False)
    steps = _runs(monkeypatch)
    first = runs.generate([PROMPTS[0]], GREEDY)[0]
    assert max(steps) > 1
    turn = PROMPTS[0] + first.token_ids[:17] + [21, 22]  # 16 generated tokens' K/V cached
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    again = runs.generate([turn], params)[0]
    assert again.num_cached_tokens >= 20
    assert again.token_ids == fresh.generate([turn], params)[0].token_ids
    runs.engine.check_invariants().raise_if_failed()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_adapter_rows_in_a_run_get_the_tokens_of_one_step_a_call(tiny, scheme, monkeypatch):
    hf, adapter = tiny
    plain, runs = _pair(hf, scheme)
    for llm in (plain, runs):
        llm.load_lora_adapter("a", adapter)
    loras = [None, "a", "a"]
    want = _answers(plain.generate(PROMPTS, GREEDY, lora=loras))
    assert want != _answers(plain.generate(PROMPTS, GREEDY))  # the adapter changes tokens
    steps = _runs(monkeypatch)
    assert _answers(runs.generate(PROMPTS, GREEDY, lora=loras)) == want
    assert steps and max(steps) > 1


def test_one_step_a_call_for_what_a_run_cannot_do(tiny, monkeypatch):
    hf, adapter = tiny
    llm = LLM(str(hf), quantization="int8", decode_steps_per_call=8)
    f32 = LLM(str(hf), decode_steps_per_call=8)
    f32.load_lora_adapter("a", adapter)
    steps = _runs(monkeypatch)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
    scored = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    llm.generate(PROMPTS, sampled)
    llm.generate(PROMPTS, scored)
    f32.generate(PROMPTS, GREEDY, lora="a")  # the fused GEMM's LoRA: the Python loop
    # a greedy request beside a sampled one as long: the batch takes one step a call
    llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=12, temperature=0.0,
                                              ignore_eos=True), sampled])
    assert steps == []
    llm.generate(PROMPTS, GREEDY)
    assert steps and max(steps) > 1


def _with_lm_head_rows(hf, root, rows: dict[int, float]) -> str:
    """A copy of the tiny model whose lm_head rows are all one vector, except `rows` (index ->
    a value every weight of that row takes): equal logits everywhere else."""
    from safetensors.torch import load_file, save_file

    out = root / "head"
    shutil.copytree(hf, out, dirs_exist_ok=True)
    (path,) = out.glob("*.safetensors")
    weights = load_file(path)
    key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    head = weights[key].clone()
    head[:] = head[0]
    for i, value in rows.items():
        head[i] = value
    weights[key] = head
    save_file(weights, path, metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize(("rows", "want"), [({}, 0), ({-1: float("nan")}, -1),
                                            ({5: float("nan"), -3: float("nan")}, 5)])
@pytest.mark.parametrize("prompts", [1, 3])
def test_a_teams_maxima_join_as_numpys_argmax(tiny, tmp_path, rows, want, prompts):
    """Where the layers run in one team of two, each thread takes the first maximum of its
    half of the logits: ties (every logit equal) go to the first column, and a NaN anywhere
    (one in each half: the first) is the maximum, as numpy's argmax (the one step a call's
    sampler) has it, at one row (each thread every row itself) and at three."""
    hf, _ = tiny
    path = _with_lm_head_rows(hf, tmp_path, rows)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain, runs = _pair(path, "none")
        vocab = runs.engine.model.config.vocab_size
        assert runs.engine.model.native.in_team(prompts)
        want_ids = _answers(plain.generate(PROMPTS[:prompts], GREEDY))
        got = _answers(runs.generate(PROMPTS[:prompts], GREEDY))
        assert got == want_ids
        assert all(ids == [want % vocab] * 20 for ids, _, _ in got)
    finally:
        torch.set_num_threads(before)
