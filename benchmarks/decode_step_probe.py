"""Decode-step time of the engine on the bundled model, stepped directly (no HTTP, no
generate loop): the batch-1 figure next to the memory-bandwidth floor, and a profile.

    .venv/bin/python benchmarks/decode_step_probe.py [--batch 1] [--steps 40] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loraserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = LLM(None).engine
    params = SamplingParams(max_tokens=3 * args.steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(list(range(100 + i, 100 + i + args.prompt_len)), params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.requests.values()):
        eng.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    floor = eng.model_config.num_params * 4 / 25e9  # weight bytes / 25 GB/s
    print(f"batch {args.batch}: median step {step * 1000:.1f} ms, {args.batch / step:.1f} tok/s;"
          f" batch-1 floor {floor * 1000:.1f} ms -> step/floor {step / floor:.2f}")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(5):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
