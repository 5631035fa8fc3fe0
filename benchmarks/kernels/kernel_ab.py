"""A/B of two builds of one CPU kernel in one process, alternating round by round.

Each side is a C source (default: the current one; an older one from a worktree of REV, so
that the files it #includes are of its time) and extra compiler flags. The host's speed
drifts from minute to minute, so the sides alternate (A B, then B A) and the figure to quote
is the median over rounds of the per-round difference or ratio.

    AB="python benchmarks/kernels/kernel_ab.py"; OLD=/tmp/old   # git worktree add $OLD REV
    $AB lora --a $OLD/loraserve/lora/sgmv_cpu.c [--tokens 64,2048] [--rounds 10]
    $AB lora --b-flags=-DLORA_BF16 --b-dtype bfloat16          # a build switch, same source
    $AB decode-op --a $OLD/loraserve/lora/gemm_lora_decode_cpu.c [--tokens 64] [--rounds 31]
    $AB decode-op --a $OLD/loraserve/lora/gemm_lora_decode_cpu.c --engine --rounds 6
    $AB attention --a $OLD/loraserve/model/attention/paged_decode.c
    $AB elementwise                                            # ours against torch's ops
    $AB qpanel --b-flags=-DQPANEL_FETCH_AHEAD_4BIT=0 [--model smollm2-135m]
    $AB gemm --b-flags=-DGEMM_NEXT_PANEL_HINT=PF_L1 [--rows 8,32,64,256]

- `lora`: the separate LoRA op (lora/sgmv_cpu.c) of one decode step and one prefill step, every
  layer and group, 16 adapters of ranks 8-64 on all seven modules; `--a-tile/--b-tile` choose
  the slot pool's tile width, `--a-dtype/--b-dtype` its weight dtype.
- `decode-op`: the interleaved decode op (lora/gemm_lora_decode_cpu.c), every projection of a
  decode step with its LoRA work, per group of projections, with the GEMMs alone for scale;
  `--engine` instead times whole multi-LoRA runs in the engine with each side's op, base-only
  runs between (multi/base per side, and the decode steps' seconds apart).
- `attention`: the paged decode attention kernel (model/attention/paged_decode.c), one cache per
  layer as a decode step reads them, at four batch shapes; effective GB/s of K and V read.
- `elementwise`: the fused element-wise kernels (ops/fused_cpu.c) against torch's separate ops
  in the engine: the offline batch, and decode at batch 64 and 1; greedy tokens must agree.
- `qpanel`: the quantized panel GEMM (ops/qpanel_gemm.c) over a model's projections at batch
  1, int8 and int4, against the copy rate measured between rounds.
- `gemm`: the float32 panel GEMM (ops/gemm_cpu.c) over a decode step's weights and lm_head at
  a few batch sizes, streamed from memory as in serving; GFLOP/s per side.

Imitated AVX2: prefix with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 LORASERVE_CPU_ARCH=x86-64-v3.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the kernel benchmarks, then benchmarks/common


def alternate(measure: Callable[[str], object], sides: Sequence[str], rounds: int,
              warm_up: bool = True) -> dict:
    """Each side measured once per round, the order flipped every round: {side: [results]}.
    With warm_up, one untimed call per side first (builds, first touches)."""
    for side in sides if warm_up else ():
        measure(side)
    out: dict[str, list] = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            out[side].append(measure(side))
    return out


def median_diff(a: list[float], b: list[float]) -> float:
    """Median over rounds of b - a."""
    return statistics.median(y - x for x, y in zip(a, b, strict=True))


def median_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num / den."""
    return statistics.median(x / y for x, y in zip(num, den, strict=True))


def add_sides(ap: argparse.ArgumentParser, default_source: Path, rounds: int) -> None:
    for side in ("a", "b"):
        ap.add_argument(f"--{side}", type=Path, default=default_source,
                        help=f"kernel source of side {side} (default: the current one)")
        ap.add_argument(f"--{side}-flags", default="", help="extra compiler flags")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=2)


def main(argv: list[str] | None = None) -> None:
    import ab_attention
    import ab_decode_op
    import ab_elementwise
    import ab_gemm
    import ab_lora
    import ab_qpanel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="kernel", required=True)
    kernels = {"lora": ab_lora, "decode-op": ab_decode_op, "attention": ab_attention,
               "elementwise": ab_elementwise, "qpanel": ab_qpanel,
               "gemm": ab_gemm}
    for name, module in kernels.items():
        module.add_args(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels[args.kernel].run(args)


if __name__ == "__main__":
    main()
