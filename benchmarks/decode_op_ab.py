"""A/B two builds of the interleaved decode op (lora/gemm_lora_decode_cpu.c) in one process,
alternating round by round: every projection of one decode step on SmolLM2 shapes with its
LoRA ops (16 adapters of ranks 8/16/32/64 on all seven modules, the step's tokens spread
evenly), and the GEMMs alone.

Each side is a source file and extra compiler flags. The source #includes ../ops/gemm_cpu.c
and sgmv_cpu.c beside it, so an older revision is compared from a worktree of it:

    git worktree add /tmp/old REV; OLD=/tmp/old/loraserve/lora/gemm_lora_decode_cpu.c
    .venv/bin/python benchmarks/decode_op_ab.py --a-src $OLD [--tokens 64] [--rounds 31]
    .venv/bin/python benchmarks/decode_op_ab.py --b-flags=-DSOME_SWITCH=1

Prints each side's median step time and the median over rounds of B - A, per group of
projections (the host drifts: the per-round difference is the figure to quote).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_op_micro import SMOLLM2, synthetic_adapter  # noqa: E402

from loraserve.adapters.slot_pool import LoraSlotPool  # noqa: E402
from loraserve.lora import gemm_lora_cpu  # noqa: E402
from loraserve.lora.backends import pool_tile_width  # noqa: E402
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend  # noqa: E402
from loraserve.lora.layout import GROUP_NAMES  # noqa: E402
from loraserve.model.linear import Linear  # noqa: E402
from loraserve.ops import cbuild  # noqa: E402

RANKS = (8, 16, 32, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-src", type=Path, default=gemm_lora_cpu.DECODE_SOURCE)
        ap.add_argument(f"--{side}-flags", default="", help="extra compiler flags")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {side: cbuild.load_library_once(getattr(args, f"{side}_src").resolve(),
                                           getattr(args, f"{side}_flags").split(), side.upper(),
                                           gemm_lora_cpu._configure_decode)
            for side in ("a", "b")}
    if None in libs.values():
        sys.exit("a side did not build (or this CPU lacks AVX2 + FMA)")
    cfg, n = SMOLLM2, args.adapters
    pool = LoraSlotPool(cfg, n, max(RANKS),
                        tile_width=pool_tile_width("cpu", torch.float32, torch.device("cpu")))
    for s in range(n):
        pool.write(s, synthetic_adapter(cfg, RANKS[s % len(RANKS)], seed=s))
    backend = CpuKernelLoraBackend(pool)
    plans = {}
    for side, lib in libs.items():  # a plan's DecodeCalls hold the library they were made with
        backend.decode_lib = lib
        plans[side] = backend.plan([(s, args.tokens // n) for s in range(n)])
    g = torch.Generator().manual_seed(0)
    linears = [{name: Linear(torch.randn(lay.d_out, lay.d_in, generator=g) * 0.02)
                for name, lay in pool.layouts.items()} for _ in range(cfg.num_hidden_layers)]
    xs = [{name: torch.randn(args.tokens // n * n, lay.d_in, generator=g)
           for name, lay in pool.layouts.items()} for _ in range(cfg.num_hidden_layers)]

    def step(side: str | None) -> dict[str, float]:
        took = dict.fromkeys(GROUP_NAMES, 0.0)
        for layer, lins in enumerate(linears):
            for name in GROUP_NAMES:
                t0 = time.perf_counter()
                if side is None:
                    lins[name](xs[layer][name])
                else:
                    backend.project(plans[side], layer, name, xs[layer][name], lins[name])
                took[name] += time.perf_counter() - t0
        took["step"] = sum(took.values())
        return took

    for side in ("a", "b", None):
        step(side)  # builds, first touches
    res: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    gemms = []
    for r in range(args.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            res[side].append(step(side))
        gemms.append(step(None)["step"])
    print(f"{args.tokens} tokens over {n} adapters, {args.threads} threads, {args.rounds} "
          f"rounds; GEMMs alone {1e3 * statistics.median(gemms):.1f} ms a step")
    for part in ("step", *GROUP_NAMES):
        a = statistics.median(t[part] for t in res["a"])
        b = statistics.median(t[part] for t in res["b"])
        d = statistics.median(y[part] - x[part] for x, y in zip(res["a"], res["b"], strict=True))
        print(f"  {part:8s} A {1e3 * a:7.2f}  B {1e3 * b:7.2f}  B - A (median of rounds) "
              f"{1e3 * d:+6.2f} ms")


if __name__ == "__main__":
    main()
