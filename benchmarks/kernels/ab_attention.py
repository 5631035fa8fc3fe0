"""the paged decode attention kernel (model/attention/paged_decode.c), per layer

SmolLM2-135M's decode shapes (9 query / 3 kv heads of 64), blocks of 16 tokens scattered over
the cache, one cache per layer (30 of them outgrow the L3 cache, so the kernel reads from
memory as it does in a decode step). Effective GB/s = K and V bytes read / time; the kernel's
floor is the memory read rate. Either side may be an older source without the sliding-window
and soft-cap arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from kernel_ab import add_sides, alternate, median_ratio

from loraserve.model.attention import paged_decode
from loraserve.ops.cbuild import compile_once

SHAPES = ((32, 160), (64, 180), (128, 576), (1, 300))  # (sequences, context tokens)
BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def add_args(ap: argparse.ArgumentParser) -> None:
    add_sides(ap, paged_decode.SOURCE, rounds=11)
    ap.add_argument("--layers", type=int, default=30, help="caches per step (SmolLM2: 30)")


def load(source: Path, flags: str):
    """A call `f(q, out, rows, k, v, tables, lens)` into `source`'s kernel, whichever of its
    two signatures the source has."""
    lib = ctypes.CDLL(str(compile_once(shutil.which("gcc"), source, flags.split())))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    windowed = "softcap" in source.read_text()
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
                   f32, *((i64, f32) if windowed else ()), ctypes.c_int]

    def call(q, out, rows, k, v, tables, lens):
        extra = (0, 0.0) if windowed else ()
        fn(q.data_ptr(), q.stride(0), rows.data_ptr(), out.data_ptr(), out.stride(0),
           k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
           rows.shape[0], q.shape[1], k.shape[1], q.shape[2], BLOCK, HEAD_DIM**-0.5, *extra,
           torch.get_num_threads())

    return call


def layer_time(libs, outs, q, rows, caches, tables, lens, side: str) -> float:
    """Seconds per layer for side's kernel over every layer's cache."""
    t = time.perf_counter()
    for k, v in caches:
        libs[side](q, outs[side], rows, k, v, tables, lens)
    return (time.perf_counter() - t) / len(caches)


def run(args: argparse.Namespace) -> None:
    libs = {side: load(getattr(args, side), getattr(args, f"{side}_flags")) for side in "ab"}
    torch.manual_seed(0)
    for n, length in SHAPES:
        nb = length // BLOCK + 1
        caches = [(torch.randn(n * nb * BLOCK, KV_HEADS, HEAD_DIM),
                   torch.randn(n * nb * BLOCK, KV_HEADS, HEAD_DIM)) for _ in range(args.layers)]
        tables = torch.randperm(n * nb).view(n, nb).contiguous()  # blocks scattered
        lens = torch.full((n,), length, dtype=torch.int64)
        rows = torch.arange(n)
        q = torch.randn(n, HEADS, HEAD_DIM)
        outs = {side: torch.empty_like(q) for side in libs}
        measure = partial(layer_time, libs, outs, q, rows, caches, tables, lens)
        times = alternate(measure, ("a", "b"), args.rounds)
        gb = 2 * n * length * KV_HEADS * HEAD_DIM * 4 / 1e9
        med = {side: statistics.median(ts) for side, ts in times.items()}
        print(f"{n:4d} seqs x {length:4d} tokens: " + "  ".join(
            f"{side} {m * 1e3:7.3f} ms ({gb / m:5.1f} GB/s)" for side, m in med.items())
            + f"  a/b (median of rounds) {median_ratio(times['a'], times['b']):.2f}x  max diff "
            f"{(outs['a'] - outs['b']).abs().max().item():.1e}")
