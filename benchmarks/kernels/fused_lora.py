"""The projections of one step with their LoRA ops: separate (the GEMM, then the C LoRA
kernel) against fused (lora/gemm_lora_cpu.py: the expand inside the GEMM's tiles for long
segments, shrink and expand interleaved with the GEMM at decode), and the GEMMs alone.

SmolLM2-135M shapes, float32, 30 layers x 4 groups, 16 adapters of ranks 8/16/32/64 on all
seven modules (as benchmarks/multi_lora.py), the step's tokens spread evenly over them. The
weights (425 MB of projections, 586 MB of adapters) are far larger than the caches, as in a
real step. Each layer has its own inputs, as in the model (one x reused by every layer would
stay in L3 and make a prefill step's LoRA ops look cheaper than they are in the engine).
Variants run interleaved, round after round; medians of each, and of the per-round ratio of
LoRA overheads (variant - GEMMs alone), for the step and per group of projections.

    .venv/bin/python benchmarks/kernels/fused_lora.py [--tokens 64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_op_micro import SMOLLM2, synthetic_adapter  # noqa: E402

from loraserve.adapters.slot_pool import LoraSlotPool  # noqa: E402
from loraserve.lora.backends import pool_tile_width  # noqa: E402
from loraserve.lora.backends.base import LoraBackend  # noqa: E402
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend  # noqa: E402
from loraserve.lora.layout import GROUP_NAMES  # noqa: E402
from loraserve.model.linear import Linear  # noqa: E402
from loraserve.ops.gemm import gemm_backend  # noqa: E402

RANKS = (8, 16, 32, 64)
Project = Callable[[int, str, torch.Tensor, Linear], object]


def smollm2_step(n: int, tokens: int):
    """A slot pool of n synthetic adapters (RANKS cycled, all seven modules) and its C-kernel
    backend, with every layer's projections and its own inputs for a step of `tokens` tokens
    spread evenly over the adapters: (backend, tokens per adapter, linears, xs)."""
    cfg = SMOLLM2
    pool = LoraSlotPool(cfg, n, max(RANKS),
                        tile_width=pool_tile_width("cpu", torch.float32, torch.device("cpu")))
    for s in range(n):
        pool.write(s, synthetic_adapter(cfg, RANKS[s % len(RANKS)], seed=s))
    per = tokens // n
    g = torch.Generator().manual_seed(0)
    linears = [{name: Linear(torch.randn(lay.d_out, lay.d_in, generator=g) * 0.02)
                for name, lay in pool.layouts.items()} for _ in range(cfg.num_hidden_layers)]
    xs = [{name: torch.randn(per * n, lay.d_in, generator=g) for name, lay in pool.layouts.items()}
          for _ in range(cfg.num_hidden_layers)]
    return CpuKernelLoraBackend(pool), per, linears, xs


def time_groups(linears: list[dict[str, Linear]], xs: list[dict[str, torch.Tensor]],
                project: Project) -> dict[str, float]:
    """Seconds per group of projections (and "step": all of them) for one step, each
    projection run as project(layer, group, x, linear)."""
    took = dict.fromkeys(GROUP_NAMES, 0.0)
    for layer, lins in enumerate(linears):
        for name in GROUP_NAMES:
            t0 = time.perf_counter()
            project(layer, name, xs[layer][name], lins[name])
            took[name] += time.perf_counter() - t0
    took["step"] = sum(took.values())
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="tokens in the step")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.adapters
    if gemm_backend() != "avx2":
        sys.exit(f"the fused op needs our GEMM; this host's backend is {gemm_backend()}")
    backend, per, linears, xs = smollm2_step(n, args.tokens)
    plan = backend.plan([(s, per) for s in range(n)])
    projects: dict[str, Project] = {
        "gemm": lambda layer, name, x, lin: lin(x),
        "separate": lambda layer, name, x, lin: LoraBackend.project(backend, plan, layer, name,
                                                                     x, lin),
        "fused": lambda layer, name, x, lin: backend.project(plan, layer, name, x, lin),
    }
    kinds = tuple(projects)
    times: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for k in kinds:
        time_groups(linears, xs, projects[k])  # warm-up: builds, first touches
    for r in range(args.rounds):
        for k in kinds if r % 2 == 0 else kinds[::-1]:
            times[k].append(time_groups(linears, xs, projects[k]))
    print(f"{args.tokens} tokens over {n} adapters ({per} each), pool tile "
          f"{backend.weights.tile_width}, {torch.get_num_threads()} threads; ms per step, medians")
    print(f"  {'':8s} {'GEMMs':>7s} {'separate adds':>14s} {'fused adds':>11s} {'fused/sep':>10s}")
    for part in ("step", *GROUP_NAMES):
        med = {k: statistics.median(t[part] for t in v) for k, v in times.items()}
        ratio = statistics.median(
            (f[part] - g[part]) / (s[part] - g[part])
            for g, s, f in zip(times["gemm"], times["separate"], times["fused"], strict=True))
        print(f"  {part:8s} {1e3 * med['gemm']:7.1f} {1e3 * (med['separate'] - med['gemm']):14.1f}"
              f" {1e3 * (med['fused'] - med['gemm']):11.1f} {ratio:10.2f}")


if __name__ == "__main__":
    main()
