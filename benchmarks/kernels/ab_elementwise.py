"""the fused element-wise kernels (ops/fused_cpu.c) against torch's ops, in the engine

One engine on the bundled model, the kernels switched on and off run by run: the offline
batch (prompts x input tokens -> output tokens, greedy), and decode steps at batch 64 and at
batch 1. Greedy tokens must be equal either way. Writes
docs/bench-results/kernel_ab-elementwise.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import random_prompts, write_result
from kernel_ab import alternate, median_ratio
from offline_throughput import decode_rate

from loraserve import LLM, SamplingParams
from loraserve.model.bundled import default_model_dir
from loraserve.ops import elementwise


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)


def run(args: argparse.Namespace) -> None:
    llm = LLM(default_model_dir(), enable_prefix_caching=False)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    tokens = {}

    def measure(side: str) -> dict[str, float]:
        elementwise.set_enabled(side == "fused")
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        res = {"offline_s": time.perf_counter() - t,
               "decode64_tok_s": decode_rate(llm, prompts, 16),
               "decode1_tok_s": decode_rate(llm, prompts[:1], 32)}
        tokens[side] = [o.token_ids for o in outs]
        print(side, {k: round(v, 3) for k, v in res.items()}, flush=True)
        return res

    try:
        runs = alternate(measure, ("fused", "torch"), args.rounds, warm_up=False)
    finally:
        elementwise.set_enabled(True)

    def series(side: str, key: str) -> list[float]:
        return [r[key] for r in runs[side]]

    keys = ("offline_s", "decode64_tok_s", "decode1_tok_s")
    res = {
        "workload": {k: v for k, v in vars(args).items() if k != "kernel"},
        "medians": {side: {k: statistics.median(series(side, k)) for k in keys}
                    for side in runs},
        "offline_speedup": median_ratio(series("torch", "offline_s"), series("fused", "offline_s")),
        "decode64_speedup": median_ratio(series("fused", "decode64_tok_s"),
                                         series("torch", "decode64_tok_s")),
        "decode1_speedup": median_ratio(series("fused", "decode1_tok_s"),
                                        series("torch", "decode1_tok_s")),
        "same_greedy_tokens": tokens["fused"] == tokens["torch"],
    }
    for k, v in res.items():
        print(f"{k:20s} {v}")
    print("wrote", write_result("kernel_ab-elementwise", res))
