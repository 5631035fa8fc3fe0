"""Decode steps with adapters over quantized weights: the native layer loop (the LoRA kernel
called from C after each projection) against the Python loop, and runs of several steps a
call in the native loop (`decode_steps_per_call`, 8) against one step a call, in one engine,
rounds alternating.

    .venv/bin/python benchmarks/native_adapters.py [--rounds 6] [--quantization int8]
    .venv/bin/python tools/both_isas.py native_adapters      # native, then imitated AVX2

The bundled model with 5 synthetic PEFT adapters (rank 8 and 16, every projection), as in
vs_llamacpp.py's adapter workload. Two batches: 32 sequences over the 5 adapters, and one
sequence with an adapter; short prompts (8 tokens), so the time is the decode steps'. Per
side, milliseconds per decode step (the run's time / its steps); the figures are the medians
over rounds of the per-round ratios Python loop / native loop, one step a call (above 1:
the native loop is faster), and native one step a call / runs. The greedy tokens of all
sides must be equal (they compute the same bits).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import scratch_dir, write_result

from loraserve import LLM, SamplingParams
from loraserve.bench.make_adapters import make_synthetic_adapters
from loraserve.model.bundled import default_model_dir

SIDES = ("runs", "native", "python")  # runs: the native loop, up to 8 steps a call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="int8")
    args = ap.parse_args()
    adapters = make_synthetic_adapters(default_model_dir(), scratch_dir("loraserve-nad-"), 5,
                                       ranks=[8, 16], init_scale=0.5)
    llm = LLM(None, quantization=args.quantization, num_threads=args.threads,
              enable_prefix_caching=False,
              lora_paths={f"lora{i}": str(a) for i, a in enumerate(adapters)})
    model = llm.engine.model
    native = model.native
    if native is None or not native.takes_lora:
        raise SystemExit("the native loop does not take adapter steps on this model/build")
    rng = random.Random(5)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    result = {"quantization": args.quantization, "threads": args.threads}
    for batch in (32, 1):
        prompts = [[rng.randrange(100, 49152) for _ in range(8)] for _ in range(batch)]
        names = [f"lora{i % 5}" for i in range(batch)]
        llm.generate(prompts[:5], SamplingParams(max_tokens=2, temperature=0.0), lora=names[:5])
        ms: dict[str, list[float]] = {s: [] for s in SIDES}
        tokens = {}
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                model.native = None if side == "python" else native
                llm.engine.decode_runs.most = 8 if side == "runs" else 1
                start = time.perf_counter()
                outs = llm.generate(prompts, sp, lora=names)
                ms[side].append((time.perf_counter() - start) / args.tokens * 1e3)
                tokens[side] = [o.token_ids for o in outs]
        model.native = native
        ratios = [p / n for n, p in zip(ms["native"], ms["python"], strict=True)]
        gains = [n / r for r, n in zip(ms["runs"], ms["native"], strict=True)]
        same = tokens["native"] == tokens["python"] == tokens["runs"]
        result[f"batch{batch}"] = {"ms_per_step": {s: [round(x, 2) for x in v]
                                                   for s, v in ms.items()},
                                   "python_over_native": round(statistics.median(ratios), 3),
                                   "range": [round(min(ratios), 3), round(max(ratios), 3)],
                                   "native_over_runs": round(statistics.median(gains), 3),
                                   "runs_range": [round(min(gains), 3), round(max(gains), 3)],
                                   "greedy_equal": same}
        print(f"{batch} sequences: runs {statistics.median(ms['runs']):.2f} ms/step, native "
              f"{statistics.median(ms['native']):.2f}, python "
              f"{statistics.median(ms['python']):.2f}: python / native "
              f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f}), "
              f"native / runs **{statistics.median(gains):.2f}** "
              f"({min(gains):.2f}-{max(gains):.2f}), greedy equal: {same}", flush=True)
        if not same:
            raise SystemExit("the two loops gave different tokens")
    write_result("native_adapters", result)


if __name__ == "__main__":
    main()
