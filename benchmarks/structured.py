"""Structured outputs' cost on the bundled model: decode step time of a 32-request batch
(base and two demo adapters mixed) with 0%, 50% and 100% of its requests constrained by a JSON
schema, the token mask's own time (fill, off the engine thread, and apply), and grammar compile
time p50/p99 over real-world schemas (benchmarks/data/schemas.json).

Rounds alternate the three mixes (A/B/C, then rotated) and report medians; only decode steps
with all 32 requests in the batch count.

    PYTHONPATH=. .venv/bin/python benchmarks/structured.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import write_result

from loraserve import LLM, SamplingParams
from loraserve.engine import runner as runner_module
from loraserve.model.bundled import default_model_dir
from loraserve.model.structured import compiler as compiler_module
from loraserve.model.structured.mask import PendingMask
from loraserve.types import StructuredOutput

SCHEMAS = json.loads((Path(__file__).parent / "data" / "schemas.json").read_text())
BATCH, STEPS = 32, 24
# long enough that no constrained request can finish within STEPS tokens
LONG = {"type": "object", "additionalProperties": False, "required": ["items"],
        "properties": {"items": {"type": "array", "minItems": 12,
                                 "items": {"type": "object", "additionalProperties": False,
                                           "required": ["name", "qty"],
                                           "properties": {"name": {"type": "string",
                                                                   "maxLength": 16},
                                                          "qty": {"type": "integer"}}}}}}
TOPICS = ["fruit", "tools", "books", "cities", "planets", "songs", "colours", "animals"]


class DecodeTimer:
    """Seconds of every decode-only step with `BATCH` rows, and the mask's own seconds."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.apply: list[float] = []
        self.fill: list[float] = []
        execute = runner_module.ModelRunner.execute
        apply = PendingMask.apply
        timer = self

        def timed(runner, batch, slots):
            t = time.perf_counter()
            out = execute(runner, batch, slots)
            if len(batch.entries) == BATCH and all(n == 1 for _, n in batch.entries):
                timer.steps.append(time.perf_counter() - t)
            return out

        def timed_apply(pending, logits):
            t = time.perf_counter()
            pending.filled.result()
            timer.fill.append(time.perf_counter() - t)  # what the fill still cost the step
            t = time.perf_counter()
            out = apply(pending, logits)
            timer.apply.append(time.perf_counter() - t)
            return out

        runner_module.ModelRunner.execute = timed
        PendingMask.apply = timed_apply

    def take(self) -> tuple[list[float], list[float], list[float]]:
        out = (self.steps, self.fill, self.apply)
        self.steps, self.fill, self.apply = [], [], []
        return out


def fill_alone(llm: LLM, spec: StructuredOutput, reps: int = 30) -> float:
    """Median seconds to fill 32 rows' masks at the start of the schema, nothing else running."""
    masker = llm.engine.runner.masker
    grammar = llm.engine.grammars.compile(spec)
    matchers = [grammar.new_matcher() for _ in range(BATCH)]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        masker.start(matchers).filled.result()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_mix(llm: LLM, fraction: float, spec: StructuredOutput) -> None:
    chats, params, loras = [], [], []
    for i in range(BATCH):
        constrained = i < round(fraction * BATCH)
        chats.append([{"role": "user", "content": f"List {TOPICS[i % 8]} #{i} as JSON."}])
        params.append(SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True,
                                     structured_outputs=spec if constrained else None))
        loras.append([None, "pirate", "french"][i % 3])
    llm.chat(chats, params, lora=loras)


def compile_times(llm: LLM, reps: int) -> dict:
    """Fresh compiles (no cache) of every schema, `reps` times each, alternating order."""
    tok = llm.engine.grammars.tokenizer
    import llguidance

    times: dict[str, list[float]] = {name: [] for name in SCHEMAS}
    for r in range(reps):
        for name in (list(SCHEMAS) if r % 2 == 0 else reversed(list(SCHEMAS))):
            t = time.perf_counter()
            text = compiler_module.grammar_text(StructuredOutput("json",
                                                                 json.dumps(SCHEMAS[name])))
            m = llguidance.LLMatcher(tok, text, log_level=0)
            times[name].append(time.perf_counter() - t)
            assert not m.is_error(), (name, m.get_error())
    flat = sorted(x for v in times.values() for x in v)
    return {"p50_ms": 1e3 * statistics.median(flat),
            "p99_ms": 1e3 * flat[min(len(flat) - 1, round(0.99 * (len(flat) - 1)))],
            "max_ms": 1e3 * flat[-1],
            "per_schema_median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    demo = Path(__file__).resolve().parent.parent / "loraserve" / "demo" / "data"
    llm = LLM(default_model_dir(), lora_paths={n: str(demo / n) for n in ("pirate", "french")},
              enable_prefix_caching=False, kv_cache_tokens=16384)
    spec = StructuredOutput("json", json.dumps(LONG))
    timer = DecodeTimer()
    fractions = [0.0, 0.5, 1.0]
    for f in fractions:  # warm-up: first touches, grammar compile, tokenizer build
        t = time.perf_counter()
        run_mix(llm, f, spec)
        print(f"warm-up {f:.0%}: {time.perf_counter() - t:.1f} s", flush=True)
    timer.take()
    steps = {f: [] for f in fractions}
    fills, applies = [], []
    for r in range(args.rounds):
        order = fractions[r % 3:] + fractions[:r % 3]
        for f in order:
            run_mix(llm, f, spec)
            s, fi, ap_ = timer.take()
            steps[f].append(statistics.median(s))
            if f == 1.0:
                fills += fi
                applies += ap_
    base = statistics.median(steps[0.0])
    result = {
        "batch": BATCH, "decode_steps_per_run": STEPS, "rounds": args.rounds,
        "threads": args.threads,
        "decode_step_ms": {f"{int(f * 100)}%": 1e3 * statistics.median(v)
                           for f, v in steps.items()},
        "ratio_vs_0%": {f"{int(f * 100)}%": statistics.median(v) / base
                        for f, v in steps.items()},
        "per_round_ms": {f"{int(f * 100)}%": [round(1e3 * x, 1) for x in v]
                         for f, v in steps.items()},
        "mask_at_100%_ms": {"fill_wait_after_forward": 1e3 * statistics.median(fills),
                            "apply": 1e3 * statistics.median(applies),
                            "fill_alone_32_rows": 1e3 * fill_alone(llm, spec)},
        "compile": compile_times(llm, reps=5),
    }
    print(json.dumps(result, indent=2))
    print("wrote", write_result("structured", result))


if __name__ == "__main__":
    main()
