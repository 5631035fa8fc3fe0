"""the float32 panel GEMM (ops/gemm_cpu.c) over a decode step's weights, streamed from memory

Every projection of a model's layers and its lm_head (the bundled SmolLM2-135M's shapes, or
SmolLM2-360M's), each packed as the engine packs it, multiplied by `--rows` rows of x back to
back: what a decode step of that many sequences computes, with the weights coming from memory
(they are several times the last-level cache), as they do in serving. A GEMM timed on one
weight over and over reads it from cache instead and hides how the next panel arrives.
GFLOP/s per side, against the FMA peak of side a's build measured between the batch sizes
(fma_peak.c); both sides must give the same bits (a fetch hint or a blocking change does
not change the arithmetic): the largest difference is printed.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from ab_qpanel import MODELS, projection_shapes
from kernel_ab import add_sides, alternate, median_ratio

from loraserve.ops import gemm
from loraserve.ops.cbuild import load_library_once

FMA_PEAK = Path(__file__).with_name("fma_peak.c")


def fma_peak(flags: list[str]) -> Callable[[], float]:
    """GFLOP/s of FMAs alone on every thread, for the ISA a side's build targets."""
    def configure(lib: ctypes.CDLL) -> ctypes.CDLL:
        lib.fma_peak_gflops.argtypes = [ctypes.c_int64, ctypes.c_int]
        lib.fma_peak_gflops.restype = ctypes.c_double
        return lib

    lib = load_library_once(FMA_PEAK, flags, "the FMA peak probe", configure)
    if lib is None:
        raise SystemExit("fma_peak.c did not build")
    return lambda: lib.fma_peak_gflops(20_000_000, torch.get_num_threads())


def add_args(ap: argparse.ArgumentParser) -> None:
    add_sides(ap, gemm._SOURCE, rounds=16)
    ap.add_argument("--model", default="smollm2-135m", choices=MODELS)
    ap.add_argument("--rows", default="8,32,64,256", help="comma-separated batch sizes")
    ap.add_argument("--vocab", type=int, default=49152, help="lm_head rows")


def step_gflops(libs, weights, xs, outs, rows: int, side: str) -> float:
    lib, flops = libs[side], 0
    t = time.perf_counter()
    for panels, n, k in weights:
        lib.gemm_packed(xs[k].data_ptr(), k, panels.data_ptr(), rows, n, k,
                        outs[side][n].data_ptr(), n, torch.get_num_threads())
        flops += 2 * rows * n * k
    return flops / (time.perf_counter() - t) / 1e9


def run(args: argparse.Namespace) -> None:
    libs = {side: load_library_once(getattr(args, side), getattr(args, f"{side}_flags").split(),
                                    f"side {side}", gemm._configure) for side in ("a", "b")}
    if None in libs.values():
        raise SystemExit("a side's GEMM kernel did not build")
    shapes, layers = projection_shapes(args.model)
    d = shapes[1][0]
    weights = [(gemm.pack_panels(torch.randn(n, k) * 0.02), n, k)
               for n, k in shapes * layers + [(args.vocab, d)]]
    mb = sum(p.numel() * 4 for p, _, _ in weights) / 2**20
    print(f"{args.model}: {len(weights)} weights, {mb:.0f} MiB packed; threads "
          f"{torch.get_num_threads()}; a {args.a} {args.a_flags!r}, b {args.b} {args.b_flags!r}")
    peak = fma_peak(args.a_flags.split())
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for _, _, k in weights}
        outs = {side: {n: torch.empty(rows, n) for _, n, _ in weights} for side in libs}
        res = alternate(partial(step_gflops, libs, weights, xs, outs, rows), ("a", "b"),
                        args.rounds)
        diff = max((outs["a"][n] - outs["b"][n]).abs().max().item() for n in outs["a"])
        fma = max(peak() for _ in range(3))
        print(f"rows {rows:4d}: GFLOP/s a {statistics.median(res['a']):6.1f}  b "
              f"{statistics.median(res['b']):6.1f}  b/a {median_ratio(res['b'], res['a']):.3f}"
              f"  FMA peak {fma:6.1f}, a / peak {statistics.median(res['a']) / fma:.2f}"
              f"  (rounds {len(res['a'])}, largest |a - b| {diff:.1e})", flush=True)
