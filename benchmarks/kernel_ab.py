"""A/B two builds of the C LoRA kernel in one process, interleaved: the LoRA ops of one decode
step and of one 2048-token prefill step on SmolLM2 shapes (16 adapters, ranks cycling
8/16/32/64 as in multi_lora.py, all seven modules).

Each side is a kernel source (e.g. an older one from `git show REV:loraserve/lora/sgmv_cpu.c`),
extra compiler flags, and the adapter weight dtype the build expects. Both sides use the
current slot-pool layout, so compare sources that agree on it.

    .venv/bin/python benchmarks/kernel_ab.py --a /tmp/old.c --b loraserve/lora/sgmv_cpu.c
    .venv/bin/python benchmarks/kernel_ab.py --b-flags=-DLORA_BF16 --b-dtype bfloat16

Reports each side's median time per step and the median of the per-round ratios b/a.
KAB_THREADS=N runs both on N threads (default 2). Each side reads a pool of its build's
preferred tile width (16 on AVX2, 64 on AVX-512; 64 for sources older than the tile argument),
or --a-tile / --b-tile.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_op_micro import SMOLLM2, synthetic_adapter  # noqa: E402

from loraserve.adapters.slot_pool import LoraSlotPool  # noqa: E402
from loraserve.lora import sgmv_cpu  # noqa: E402
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend  # noqa: E402
from loraserve.lora.layout import GROUP_NAMES  # noqa: E402
from loraserve.ops.cbuild import arch_flags  # noqa: E402

NUM_ADAPTERS = 16


def build(src: str, flags: str, dtype: torch.dtype, out_dir: Path, tag: str) -> ctypes.CDLL:
    out = out_dir / f"kernel_{tag}.so"
    subprocess.run(["gcc", *sgmv_cpu.CFLAGS, *arch_flags(), *flags.split(), src, "-o", str(out)],
                   check=True)
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


def step(lib: ctypes.CDLL, pools: dict, seqs: list, xs: dict, ys: dict) -> float:
    """Seconds for the LoRA ops of one step (every layer and group) on `lib`."""
    pool = pools[lib.weight_dtype, lib.tile]
    backend = CpuKernelLoraBackend(pool)
    backend.kernel = lib  # this side's build instead of the cached one
    plan = backend.plan(seqs)
    t0 = time.perf_counter()
    for layer in range(SMOLLM2.num_hidden_layers):
        for g in GROUP_NAMES:
            backend.apply(plan, layer, g, xs[g], ys[g])
    return time.perf_counter() - t0


def main() -> None:
    here = str(sgmv_cpu.SOURCE)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default=here, help="kernel source of side a")
    ap.add_argument("--b", default=here, help="kernel source of side b")
    ap.add_argument("--a-flags", default="")
    ap.add_argument("--b-flags", default="")
    ap.add_argument("--a-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--b-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--a-tile", type=int, default=0, help="pool tile width (0: preferred)")
    ap.add_argument("--b-tile", type=int, default=0)
    ap.add_argument("--tokens", default="64,2048", help="tokens per step, comma-separated")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(int(__import__("os").environ.get("KAB_THREADS", 2)))
    tmp = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    sides = [(build(args.a, args.a_flags, getattr(torch, args.a_dtype), tmp, "a"), "a"),
             (build(args.b, args.b_flags, getattr(torch, args.b_dtype), tmp, "b"), "b")]
    ranks = [(8, 16, 32, 64)[k % 4] for k in range(NUM_ADAPTERS)]
    pools: dict[tuple[torch.dtype, int], LoraSlotPool] = {}
    for (lib, _), tile in zip(sides, (args.a_tile, args.b_tile), strict=True):
        lib.tile = tile or lib.preferred
        if (lib.weight_dtype, lib.tile) not in pools:
            pool = LoraSlotPool(SMOLLM2, NUM_ADAPTERS, 64, dtype=lib.weight_dtype,
                                tile_width=lib.tile)
            for s, r in enumerate(ranks):
                pool.write(s, synthetic_adapter(SMOLLM2, r, s))
            pools[lib.weight_dtype, lib.tile] = pool
    layouts = next(iter(pools.values())).layouts
    for T in (int(t) for t in args.tokens.split(",")):
        seqs = [(s, 1) for s in range(NUM_ADAPTERS) for _ in range(T // NUM_ADAPTERS)]
        xs = {g: torch.randn(T, lay.d_in) for g, lay in layouts.items()}
        ys = {g: torch.zeros(T, lay.d_out) for g, lay in layouts.items()}

        times: dict[str, list[float]] = {"a": [], "b": []}
        for lib, _ in sides:
            step(lib, pools, seqs, xs, ys)  # warm-up
        for _ in range(args.rounds):
            for lib, tag in sides:
                times[tag].append(step(lib, pools, seqs, xs, ys))
        ratio = statistics.median(b / a for a, b in zip(times["a"], times["b"], strict=True))
        print(f"{T:5d} tokens: a {statistics.median(times['a']) * 1e3:7.1f} ms  "
              f"b {statistics.median(times['b']) * 1e3:7.1f} ms  b/a {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
