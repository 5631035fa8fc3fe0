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

`--engine` times whole runs of multi_lora.py's workload in the engine instead (64 requests,
128 in, 64 out, over 16 adapters), the engine's decode op switched between A and B run by run,
with base-only runs between: each side's multi/base and the per-round B - A in seconds.
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
    ap.add_argument("--engine", action="store_true", help="whole engine runs (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {side: cbuild.load_library_once(getattr(args, f"{side}_src").resolve(),
                                           getattr(args, f"{side}_flags").split(), side.upper(),
                                           gemm_lora_cpu._configure_decode)
            for side in ("a", "b")}
    if None in libs.values():
        sys.exit("a side did not build (or this CPU lacks AVX2 + FMA)")
    if args.engine:
        engine_ab(libs, args.rounds)
        return
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


def engine_ab(libs: dict, rounds: int) -> None:
    """Whole multi-LoRA runs in the engine with each side's decode op, and base-only runs."""
    from common import random_prompts, scratch_dir, time_ours

    from loraserve import LLM
    from loraserve.bench.make_adapters import make_synthetic_adapters
    from loraserve.model.bundled import default_model_dir

    model_dir = default_model_dir()
    paths = make_synthetic_adapters(model_dir, scratch_dir("loraserve-decode-op-ab-"), 16,
                                    ranks=RANKS)
    names = [p.name for p in paths]
    llm = LLM(model_dir, lora_paths={p.name: str(p) for p in paths}, max_loras_per_batch=16,
              max_lora_rank=max(RANKS), enable_prefix_caching=False)
    backend = llm.engine.runner.lora
    if not isinstance(backend, CpuKernelLoraBackend):
        sys.exit(f"the engine runs the {type(backend).__name__}, not the C kernel")
    prompts = random_prompts(64, 128, llm.engine.model_config.vocab_size)
    loras = [names[i % 16] for i in range(64)]
    time_ours(llm, prompts[:16], 4, names)  # every adapter resident; full-size warm-ups
    time_ours(llm, prompts, 64, loras)
    time_ours(llm, prompts, 64, None)
    res: dict[str, list[float]] = {"a": [], "b": [], "base": []}
    for r in range(rounds):
        for side in ("a", "b", "base") if r % 2 == 0 else ("base", "b", "a"):
            if side != "base":
                backend.decode_lib = libs[side]  # read by each step's plan
            res[side].append(time_ours(llm, prompts, 64, None if side == "base" else loras))
    base = statistics.median(res["base"])
    for side in ("a", "b"):
        run = statistics.median(res[side])
        print(f"{side.upper()}: {run:.3f} s a run, multi/base {base / run:.3f}")
    d = statistics.median(y - x for x, y in zip(res["a"], res["b"], strict=True))
    print(f"B - A (median of rounds): {d:+.3f} s a run; base-only {base:.3f} s")


if __name__ == "__main__":
    main()
