"""The fused element-wise kernels (ops/fused_cpu.c) against torch's separate ops, in one process
on one engine (the bundled model), switched per run and interleaved: the offline batch workload
(prompts x input tokens -> output tokens, greedy) and decode steps at batch 64 and batch 1.
Greedy tokens must be equal with and without them.

    .venv/bin/python benchmarks/fused_ops_ab.py [--rounds 3]
    # imitated AVX2 (DESIGN.md 5): prefix with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
    #   MKL_ENABLE_INSTRUCTIONS=AVX2 LORASERVE_CPU_ARCH=x86-64-v3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import random_prompts, write_result  # noqa: E402
from offline_throughput import decode_rate  # noqa: E402

from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402
from loraserve.ops import elementwise  # noqa: E402


def ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(default_model_dir(), enable_prefix_caching=False)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    sides = {"fused": True, "torch": False}
    runs = {k: {"offline_s": [], "decode64_tok_s": [], "decode1_tok_s": []} for k in sides}
    tokens = {}
    for r in range(args.rounds):
        for name, on in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            elementwise.set_enabled(on)
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            runs[name]["offline_s"].append(time.perf_counter() - t)
            tokens[name] = [o.token_ids for o in outs]
            runs[name]["decode64_tok_s"].append(decode_rate(llm, prompts, 16))
            runs[name]["decode1_tok_s"].append(decode_rate(llm, prompts[:1], 32))
            print(name, {k: round(v[-1], 3) for k, v in runs[name].items()}, flush=True)
    elementwise.set_enabled(True)
    med = {n: {k: statistics.median(v) for k, v in m.items()} for n, m in runs.items()}
    res = {
        "workload": vars(args),
        "medians": med,
        # per round (the two sides back to back), then the median: drift between rounds cancels
        "offline_speedup": ratio(runs["torch"]["offline_s"], runs["fused"]["offline_s"]),
        "decode64_speedup": ratio(runs["fused"]["decode64_tok_s"],
                                  runs["torch"]["decode64_tok_s"]),
        "decode1_speedup": ratio(runs["fused"]["decode1_tok_s"], runs["torch"]["decode1_tok_s"]),
        "same_greedy_tokens": tokens["fused"] == tokens["torch"],
    }
    for k, v in res.items():
        print(f"{k:20s} {v}")
    print("wrote", write_result("fused_ops_ab", res))


if __name__ == "__main__":
    main()
