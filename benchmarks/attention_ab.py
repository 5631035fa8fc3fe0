"""The C paged decode attention kernel, two sources side by side in one process (alternating,
medians of 21 calls), on decode shapes of SmolLM2-135M (9 query / 3 kv heads of 64).

    git show REV:loraserve/model/attention/paged_decode.c > /tmp/old.c
    .venv/bin/python benchmarks/attention_ab.py --a /tmp/old.c
    LORASERVE_CPU_ARCH=x86-64-v3 .venv/bin/python benchmarks/attention_ab.py --a /tmp/old.c  # AVX2

Effective GB/s = K and V bytes read / time (the kernel's floor is the memory read rate).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import time
from pathlib import Path

import torch

from loraserve.model.attention import paged_decode as pd
from loraserve.ops.cbuild import compile_once

SHAPES = ((64, 180), (128, 576), (1, 300))  # (sequences, context tokens)


def load(source: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(compile_once(shutil.which("gcc"), source, [])))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr,
                                           i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=Path, required=True, help="a kernel source (e.g. the old one)")
    ap.add_argument("--b", type=Path, default=pd.SOURCE)
    args = ap.parse_args()
    libs = {"a": load(args.a), "b": load(args.b)}
    torch.manual_seed(0)
    bs, nh, kvh, hd = 16, 9, 3, 64
    for n, length in SHAPES:
        nb = length // bs + 1
        k = torch.randn(n * nb * bs, kvh, hd)
        v = torch.randn_like(k)
        tables = torch.randperm(n * nb).view(n, nb).contiguous()  # blocks scattered
        lens = torch.full((n,), length, dtype=torch.int64)
        rows = torch.arange(n)
        q = torch.randn(n, nh, hd)
        times: dict[str, list[float]] = {name: [] for name in libs}
        outs = {}
        for _ in range(21):
            for name, lib in libs.items():
                out = torch.empty_like(q)
                t = time.perf_counter()
                pd.paged_decode(lib, q, out, rows, k, v, tables, lens, bs, hd**-0.5)
                times[name].append(time.perf_counter() - t)
                outs[name] = out
        gb = 2 * n * length * kvh * hd * 4 / 1e9
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"{n:4d} seqs x {length:4d} tokens: " + "  ".join(
            f"{name} {m * 1e3:7.3f} ms ({gb / m:5.1f} GB/s)" for name, m in med.items())
            + f"  a/b {med['a'] / med['b']:.2f}x  max diff "
            f"{(outs['a'] - outs['b']).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
