"""Which GEMM backend to use on this ISA: our AVX2 kernel (ops/gemm_cpu.c), oneDNN's prepacked
linear and MKL (torch.mm on the transposed weight), on SmolLM2-135M's projections.

A pass runs every projection of 30 layers (q/k/v, o, gate/up, down: distinct weights, so they
come from memory as in a forward step) and the lm_head, at 1, 4, 16, 64 and 2048 rows (the
lm_head at min(rows, 64): only sampling rows reach it). Backends alternate within each round,
so machine noise hits all; medians of the rounds, times relative to oneDNN's.

    .venv/bin/python benchmarks/kernels/gemm_shapes.py [--rounds 7]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        LORASERVE_CPU_ARCH=x86-64-v3 .venv/bin/python benchmarks/kernels/gemm_shapes.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/common
from common import median, write_result  # noqa: E402

from loraserve.ops import gemm  # noqa: E402

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (d_out, d_in): qkv, o, gate_up,
# down
LM_HEAD = (49152, 576)


def backends(weight: torch.Tensor) -> dict:
    """name -> a function of x computing x @ weight.T on that backend's packed weight."""
    n = weight.shape[0]
    wt, packed = weight.t().contiguous(), gemm.pack_weight(weight)
    out = {"mkl": lambda x: torch.mm(x, wt),
           "onednn": lambda x: gemm.onednn_linear(x, packed)}
    if gemm._kernel() is not None:
        panels = gemm.pack_panels(weight)
        out["avx2"] = lambda x: gemm.panel_linear(x, panels, n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("torch dispatches to", torch.backends.cpu.get_cpu_capability(),
          "| auto picks", gemm.gemm_backend())
    g = torch.Generator().manual_seed(0)
    layers = [[backends(torch.randn(*s, generator=g) * 0.02) for s in SHAPES]
              for _ in range(LAYERS)]
    lm_head = backends(torch.randn(*LM_HEAD, generator=g) * 0.02)
    names = list(lm_head)
    res = {}
    for rows in (1, 4, 16, 64, 2048):
        xs = {d: torch.randn(rows, d, generator=g) for d in (576, 1536)}
        x_lm = torch.randn(min(rows, 64), 576, generator=g)
        flops = 2 * rows * LAYERS * sum(a * b for a, b in SHAPES) + 2 * x_lm.shape[0] * 576 * 49152
        times = {b: [] for b in names}
        for r in range(args.rounds if rows < 2048 else max(3, args.rounds // 2)):
            for b in names[r % len(names):] + names[: r % len(names)]:
                t = time.perf_counter()
                for layer in layers:
                    for (_, d_in), fns in zip(SHAPES, layer, strict=True):
                        fns[b](xs[d_in])
                lm_head[b](x_lm)
                times[b].append(time.perf_counter() - t)
        med = {b: median(v) for b, v in times.items()}
        res[rows] = {b: {"ms": med[b] * 1e3, "gflops": flops / med[b] / 1e9,
                         "vs_onednn": med[b] / med["onednn"]} for b in names}
        print(f"rows {rows:5d}  " + "  ".join(
            f"{b} {med[b] * 1e3:8.1f} ms {flops / med[b] / 1e9:5.0f} GF/s "
            f"({med[b] / med['onednn']:.2f}x oneDNN)" for b in names), flush=True)
    info = {"capability": torch.backends.cpu.get_cpu_capability(), "auto": gemm.gemm_backend()}
    print("wrote", write_result("gemm_shapes", {**info, "rows": res}))


if __name__ == "__main__":
    main()
