"""MKL (torch.mm on the transposed weight) against oneDNN's prepacked linear on every projection
shape of SmolLM2-135M at 1, 64 and 2048 rows: which GEMM backend to use on this ISA.

    .venv/bin/python benchmarks/gemm_shapes.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python benchmarks/gemm_shapes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import median_time  # noqa: E402

from loraserve.ops.gemm import onednn_linear, pack_weight  # noqa: E402

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]  # (d_in, d_out): qkv, gate_up,
# down, lm_head


def main() -> None:
    print("torch dispatches to", torch.backends.cpu.get_cpu_capability())
    for m in (1, 64, 2048):
        for k, n in SHAPES:
            if m == 2048 and n == 49152:
                continue  # the lm_head only sees the rows that sample
            x, w = torch.randn(m, k), torch.randn(n, k)
            wt, packed = w.t().contiguous(), pack_weight(w)
            reps = 50 if m < 2048 else 8
            mkl = median_time(lambda: torch.mm(x, wt), reps)  # noqa: B023
            dnnl = median_time(lambda: onednn_linear(x, packed), reps)  # noqa: B023
            gf = 2 * m * k * n / 1e9
            print(f"m={m:5d} k={k:5d} n={n:6d}  mkl {gf / mkl:6.1f}  onednn {gf / dnnl:6.1f} "
                  f"GFLOP/s  onednn/mkl {mkl / dnnl:.2f}x")


if __name__ == "__main__":
    main()
