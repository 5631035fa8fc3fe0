"""the separate LoRA op (lora/sgmv_cpu.c): a decode step's and a prefill step's LoRA ops

SmolLM2 shapes, 16 adapters of ranks 8/16/32/64 (as multi_lora.py), all seven modules, every
layer and group. Both sides read the current slot-pool layout (of their build's preferred tile
width unless --a-tile/--b-tile say otherwise), so compare sources that agree on it; a source
older than the tile argument reads 64-wide tiles.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from kernel_ab import add_sides, alternate, median_ratio
from lora_op_micro import SMOLLM2, synthetic_adapter

from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.lora import sgmv_cpu
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend
from loraserve.lora.layout import GROUP_NAMES
from loraserve.ops.cbuild import arch_flags

NUM_ADAPTERS = 16
RANKS = (8, 16, 32, 64)


def add_args(ap: argparse.ArgumentParser) -> None:
    add_sides(ap, sgmv_cpu.SOURCE, rounds=10)
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="adapter weight dtype (bfloat16 builds with -DLORA_BF16)")
        ap.add_argument(f"--{side}-tile", type=int, default=0,
                        help="slot pool tile width (0: the build's preferred one)")
    ap.add_argument("--tokens", default="64,2048", help="tokens per step, comma-separated")


def build(src: Path, flags: str, dtype: torch.dtype, out_dir: Path, tag: str) -> ctypes.CDLL:
    out = out_dir / f"kernel_{tag}.so"
    # the dtype's own flags, as the engine builds it (bfloat16: -DLORA_BF16)
    subprocess.run(["gcc", *sgmv_cpu.CFLAGS, *arch_flags(), *sgmv_cpu.WEIGHT_FLAGS[dtype],
                    *flags.split(), str(src), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.lora_sgmv
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64]
    if hasattr(lib, "lora_preferred_tile"):  # takes the pool's tile width before the threads
        fn.argtypes += [i64, ctypes.c_int]
        lib.preferred = lib.lora_preferred_tile()
    else:  # an older source: 64-wide tiles, no tile argument
        fn.argtypes += [ctypes.c_int]
        lib.lora_sgmv = lambda *a: fn(*a[:-2], a[-1])
        lib.preferred = 64
    lib.weight_dtype = dtype
    return lib


def step(libs: dict, pools: dict, seqs: list, xs: dict, ys: dict, side: str) -> float:
    """Seconds for the LoRA ops of one step (every layer and group) on side's build."""
    lib = libs[side]
    backend = CpuKernelLoraBackend(pools[lib.weight_dtype, lib.tile])
    backend.kernel = lib  # this side's build instead of the cached one
    plan = backend.plan(seqs)
    t0 = time.perf_counter()
    for layer in range(SMOLLM2.num_hidden_layers):
        for g in GROUP_NAMES:
            backend.apply(plan, layer, g, xs[g], ys[g])
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    libs = {side: build(getattr(args, side), getattr(args, f"{side}_flags"),
                        getattr(torch, getattr(args, f"{side}_dtype")), tmp, side)
            for side in ("a", "b")}
    ranks = [RANKS[k % len(RANKS)] for k in range(NUM_ADAPTERS)]
    pools: dict[tuple[torch.dtype, int], LoraSlotPool] = {}
    for side, lib in libs.items():
        lib.tile = getattr(args, f"{side}_tile") or lib.preferred
        if (lib.weight_dtype, lib.tile) not in pools:
            pool = LoraSlotPool(SMOLLM2, NUM_ADAPTERS, max(RANKS), dtype=lib.weight_dtype,
                                tile_width=lib.tile)
            for s, r in enumerate(ranks):
                pool.write(s, synthetic_adapter(SMOLLM2, r, s))
            pools[lib.weight_dtype, lib.tile] = pool
    layouts = next(iter(pools.values())).layouts
    for tokens in (int(t) for t in args.tokens.split(",")):
        seqs = [(s, 1) for s in range(NUM_ADAPTERS) for _ in range(tokens // NUM_ADAPTERS)]
        xs = {g: torch.randn(tokens, lay.d_in) for g, lay in layouts.items()}
        ys = {g: torch.zeros(tokens, lay.d_out) for g, lay in layouts.items()}
        times = alternate(partial(step, libs, pools, seqs, xs, ys), ("a", "b"), args.rounds)
        a, b = (statistics.median(times[s]) for s in ("a", "b"))
        print(f"{tokens:5d} tokens: a {a * 1e3:7.1f} ms  b {b * 1e3:7.1f} ms  "
              f"b/a (median of rounds) {median_ratio(times['b'], times['a']):.3f}", flush=True)
