"""Where multi-LoRA's extra time goes in the engine: prefill steps against decode steps.

Runs `multi_lora.py`'s default workload (64 requests of 128 tokens, 64 out, over 16 adapters of
rank 8-64 on all seven modules) with every adapter mixed in, and base-only on the same prompts,
in alternating order. Each model step is timed; a step with more tokens than sequences holds
prefill tokens. Prints the medians of both kinds of run and of the per-pair differences.

    .venv/bin/python benchmarks/multi_step_split.py [--pairs 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import StepTimes, mixed_adapter_workload, time_ours  # noqa: E402

FIELDS = ("run", "prefill", "decode")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm, prompts, loras = mixed_adapter_workload("loraserve-multi-step-split-")
    steps = StepTimes()
    runs: dict[str, list[tuple[float, float, float]]] = {"multi": [], "base": []}
    for i in range(args.pairs):
        for kind in ("multi", "base") if i % 2 == 0 else ("base", "multi"):
            steps.clear()
            t = time.perf_counter()
            time_ours(llm, prompts, 64, loras if kind == "multi" else None)
            runs[kind].append((time.perf_counter() - t, *steps.split()))
    for kind, rows in runs.items():
        print(f"{kind:5s} " + "  ".join(f"{f} {statistics.median(r[j] for r in rows):.3f} s"
                                        for j, f in enumerate(FIELDS)))
    pairs = list(zip(runs["multi"], runs["base"], strict=True))
    print("multi - base, median of pairs: " + "  ".join(
        f"{f} {statistics.median(m[j] - b[j] for m, b in pairs):+.3f} s"
        for j, f in enumerate(FIELDS)))
    print(f"multi/base throughput, median of pairs: "
          f"{statistics.median(b[0] / m[0] for m, b in pairs):.3f}")


if __name__ == "__main__":
    main()
