"""The C paged decode attention kernel, two sources side by side in one process (alternating,
medians of 11 steps over 30 layers' caches), on decode shapes of SmolLM2-135M (9 query / 3 kv
heads of 64).

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

from loraserve.model.attention import paged_decode as pd  # noqa: F401  (SOURCE)
from loraserve.ops.cbuild import compile_once

SHAPES = ((64, 180), (128, 576), (1, 300))  # (sequences, context tokens)


def load(source: Path):
    """A call `f(q, out, rows, k, v, tables, lens, bs, scale)` into `source`'s kernel, whichever
    of its two signatures the source has (window and softcap arrived in a later one)."""
    lib = ctypes.CDLL(str(compile_once(shutil.which("gcc"), source, [])))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    windowed = "softcap" in source.read_text()
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
                   f32, *((i64, f32) if windowed else ()), ctypes.c_int]

    def call(q, out, rows, k, v, tables, lens, bs, scale):
        extra = (0, 0.0) if windowed else ()
        fn(q.data_ptr(), q.stride(0), rows.data_ptr(), out.data_ptr(), out.stride(0),
           k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
           rows.shape[0], q.shape[1], k.shape[1], q.shape[2], bs, scale, *extra,
           torch.get_num_threads())

    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=Path, required=True, help="a kernel source (e.g. the old one)")
    ap.add_argument("--b", type=Path, default=pd.SOURCE)
    ap.add_argument("--layers", type=int, default=30, help="caches per step (SmolLM2: 30)")
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    libs = {"a": load(args.a), "b": load(args.b)}
    torch.manual_seed(0)
    bs, nh, kvh, hd = 16, 9, 3, 64
    for n, length in SHAPES:
        nb = length // bs + 1
        # one cache per layer, as a decode step reads them: 30 of them outgrow the L3 cache,
        # so the kernel reads from memory, as it does in the engine
        caches = [(torch.randn(n * nb * bs, kvh, hd), torch.randn(n * nb * bs, kvh, hd))
                  for _ in range(args.layers)]
        tables = torch.randperm(n * nb).view(n, nb).contiguous()  # blocks scattered
        lens = torch.full((n,), length, dtype=torch.int64)
        rows = torch.arange(n)
        q = torch.randn(n, nh, hd)
        times: dict[str, list[float]] = {name: [] for name in libs}
        outs = {}
        for _ in range(args.reps):
            for name, lib in libs.items():
                out = torch.empty_like(q)
                t = time.perf_counter()
                for k, v in caches:
                    lib(q, out, rows, k, v, tables, lens, bs, hd**-0.5)
                times[name].append((time.perf_counter() - t) / len(caches))
                outs[name] = out
        gb = 2 * n * length * kvh * hd * 4 / 1e9
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"{n:4d} seqs x {length:4d} tokens: " + "  ".join(
            f"{name} {m * 1e3:7.3f} ms ({gb / m:5.1f} GB/s)" for name, m in med.items())
            + f"  a/b {med['a'] / med['b']:.2f}x  max diff "
            f"{(outs['a'] - outs['b']).abs().max().item():.1e}")

if __name__ == "__main__":
    main()
