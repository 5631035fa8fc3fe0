"""llguidance vs XGrammar on the bundled model's tokenizer: tokenizer set-up, JSON-schema
compile time (p50/p99 over benchmarks/data/schemas.json, no cache, both engines alternating)
and the time to fill a 32-row batch's token bitmask along random walks through the schemas.
XGrammar is not a dependency: install it beside the project to run this
(`pip install --no-deps --target DIR xgrammar apache-tvm-ffi`, then PYTHONPATH=DIR).

    PYTHONPATH=.:DIR .venv/bin/python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import random
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import llguidance
import llguidance.hf
import torch
import xgrammar as xgr
from common import write_result
from transformers import AutoTokenizer

from loraserve.model.bundled import default_model_dir
from loraserve.model.structured.compiler import JSON_OPTIONS

SCHEMAS = list(json.loads((Path(__file__).parent / "data" / "schemas.json").read_text())
               .values())
BATCH = 32


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    torch.set_num_threads(1)
    hf = AutoTokenizer.from_pretrained(default_model_dir())
    vocab = 49152
    t = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    ll_init = time.perf_counter() - t
    t = time.perf_counter()
    x_info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    x_compiler = xgr.GrammarCompiler(x_info, max_threads=2, cache_enabled=False)
    x_init = time.perf_counter() - t

    def ll(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def xg(schema):
        return xgr.GrammarMatcher(x_compiler.compile_json_schema(json.dumps(schema),
                                                                 any_whitespace=False))

    engines = {"llguidance": ll, "xgrammar": xg}
    compile_s = {k: [] for k in engines}
    for rep in range(3):
        for schema in SCHEMAS:
            for name in (engines if rep % 2 == 0 else reversed(list(engines))):
                t = time.perf_counter()
                engines[name](schema)
                compile_s[name].append(time.perf_counter() - t)

    executor, batch = llguidance.LLExecutor(), xgr.BatchGrammarMatcher(max_threads=2)

    def walk(name: str, seed: int, steps: int = 30) -> list[float]:
        rng = random.Random(seed)
        ms = [engines[name](SCHEMAS[i % len(SCHEMAS)]) for i in range(BATCH)]
        bitmask = torch.full((BATCH, (vocab + 31) // 32), -1, dtype=torch.int32)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            if name == "llguidance":
                executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)],
                                                 bitmask.data_ptr(), bitmask.shape[1] * 4,
                                                 BATCH)
            else:
                batch.batch_fill_next_token_bitmask(ms, bitmask)
            times.append(time.perf_counter() - t)
            bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1)
            bits = bits.view(BATCH, -1)[:, :vocab]
            for i, m in enumerate(ms):
                allowed = [a for a in bits[i].nonzero().flatten().tolist() if a > 2]  # no EOS
                if not allowed:
                    m.reset()
                    continue
                tok = rng.choice(allowed[:200])
                assert m.consume_token(tok) if name == "llguidance" else m.accept_token(tok)
        return times

    fill_s = {k: [] for k in engines}
    for r in range(4):
        for name in (engines if r % 2 == 0 else reversed(list(engines))):
            fill_s[name] += walk(name, r)
    result = {"tokenizer_init_ms": {"llguidance": 1e3 * ll_init, "xgrammar": 1e3 * x_init},
              "compile_ms": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "max": pct(v, 1)}
                             for k, v in compile_s.items()},
              "fill_32_rows_ms": {k: {"median": 1e3 * statistics.median(v),
                                      "p90": pct(v, 0.9)} for k, v in fill_s.items()},
              "versions": {"llguidance": version("llguidance"), "xgrammar": version("xgrammar")}}
    print(json.dumps(result, indent=2))
    print("wrote", write_result("grammar_engines", result))


if __name__ == "__main__":
    main()
