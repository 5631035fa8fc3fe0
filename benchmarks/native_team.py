"""Batch-1 decode with the native layer loop in one OpenMP team per step, against a team per
kernel: the same engine in one process, the switch flipped between rounds.

    .venv/bin/python benchmarks/native_team.py [--rounds 10] [--tokens 32] [--model M]
    .venv/bin/python tools/both_isas.py native_team        # native, then imitated AVX2

Per quantized format (int8, int4; the bundled model also its GGUF file): the engine's time
per output token at batch 1 (memory_floor.decode_seconds) with one team per step
(`NativeDecode.use_team(True)`, the default) and with every kernel starting its own, rounds
alternating A B / B A; the figure is the median over rounds of the per-round ratio
team / per kernel (below 1: the team is faster). Greedy tokens of the two must be equal (they
compute the same bits). Each round's decode is also given against its copy-rate floor
(memory_floor.py's), with the copy rate measured just before the round.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from common import random_llama, random_prompts, scratch_dir, write_result
from memory_floor import SHAPES, copy_gbs, decode_seconds, projections

from loraserve import LLM, SamplingParams

SIDES = ("team", "per_kernel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", default="bundled", choices=["bundled", *SHAPES])
    args = ap.parse_args()
    bundled = args.model == "bundled"
    formats = ["int8", "int4"] + (["gguf"] if bundled else [])
    model_dir = None if bundled else random_llama(
        SHAPES[args.model], scratch_dir("loraserve-team-") / args.model, torch.float32)
    load_start = os.getloadavg()
    out = {}
    for f in formats:
        llm = LLM(model_dir, quantization=f, max_num_seqs=32, kv_cache_tokens=4096)
        native = llm.engine.model.native
        if native is None or not native.in_team(1):
            out[f] = {"skipped": "no native team on this build (no quantized panel kernel)"}
            continue
        nbytes = sum(lin.nbytes for lin in projections(llm.engine.model))
        prompt = random_prompts(1, 16, llm.engine.model.config.vocab_size, seed=1)[0]
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        tokens = {}
        for side in SIDES:
            native.use_team(side == "team")
            tokens[side] = llm.generate([prompt], greedy)[0].token_ids
            decode_seconds(llm, prompt, 4)  # warm
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        floors = []
        for r in range(args.rounds):
            gbs = copy_gbs(reps=2)
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                native.use_team(side == "team")
                times[side].append(decode_seconds(llm, prompt, args.tokens))
            floors.append((gbs, times["team"][-1] / (nbytes / (gbs * 1e9))))
        native.use_team(True)
        ratios = [a / b for a, b in zip(times["team"], times["per_kernel"], strict=True)]
        out[f] = {
            "ms_per_token_median": {s: round(statistics.median(t) * 1e3, 3)
                                    for s, t in times.items()},
            "team_over_per_kernel": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "greedy_equal": tokens["team"] == tokens["per_kernel"],
            "weight_mb_per_token": round(nbytes / 1e6, 1),
            "rounds_team": [{"copy_gbs": round(g, 1), "decode_over_floor": round(x, 2)}
                            for g, x in floors],
        }
        print(f, out[f], flush=True)
        del llm
    write_result("native_team" + ("" if bundled else f"-{args.model}"), {
        "model": args.model, "rounds": args.rounds, "tokens": args.tokens,
        "threads": torch.get_num_threads(), "load_start": load_start,
        "load_end": os.getloadavg(), "formats": out})


if __name__ == "__main__":
    main()
