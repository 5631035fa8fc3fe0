"""Batch-1 decode with the packed weights in the weight arena (ops/weight_arena.py: one after
another on shared 2 MB-page chunks) against each weight in an allocation of its own (what
`pack_panels` made before: 4 KB pages for every weight under 2 MB).

The bundled SmolLM2 per `--quantization` (gguf: the bundled file's own tensors), two engines
in one process (one packed each way), timed in alternating pairs: decode per token
(memory_floor.py's measure), and the median of the pairs' ratios. The host's memory
bandwidth moves from one minute to the next; a pair runs within a second, so its ratio is
what this script reports.

    .venv/bin/python benchmarks/kernels/weight_arena_ab.py [--formats none,int8,int4,gguf]
        [--pairs 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import write_result  # noqa: E402
from memory_floor import decode_seconds  # noqa: E402

from loraserve import LLM  # noqa: E402
from loraserve.ops import gemm, qpanel  # noqa: E402
from loraserve.ops.weight_arena import PACKED_WEIGHTS  # noqa: E402


class OwnAllocations:
    """The arena's interface, each tensor an allocation of its own (the layout before it)."""

    @staticmethod
    def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        from loraserve.ops.hugepages import empty_huge

        return empty_huge(*shape, dtype=dtype)  # huge pages only from 2 MB up

    @staticmethod
    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format)  # one copy, whatever the layout


def engine(fmt: str, allocator) -> LLM:
    gemm.PACKED_WEIGHTS = qpanel.PACKED_WEIGHTS = allocator
    try:
        return LLM(quantization=fmt, enable_prefix_caching=False, pace_calibration=False)
    finally:
        gemm.PACKED_WEIGHTS = qpanel.PACKED_WEIGHTS = PACKED_WEIGHTS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="none,int8,int4,gguf")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompt = list(range(100, 132))
    out = {"workload": vars(args), "formats": {}}
    for fmt in args.formats.split(","):
        llms = {"own": engine(fmt, OwnAllocations), "arena": engine(fmt, PACKED_WEIGHTS)}
        for llm in llms.values():
            decode_seconds(llm, prompt, 4)  # first touch, kernels built
        ms = {k: [] for k in llms}
        for i in range(args.pairs):
            for k in (("own", "arena") if i % 2 == 0 else ("arena", "own")):
                ms[k].append(decode_seconds(llms[k], prompt, args.tokens) * 1e3)
        ratios = [a / o for o, a in zip(ms["own"], ms["arena"], strict=True)]
        out["formats"][fmt] = {
            "own_ms_median": statistics.median(ms["own"]),
            "arena_ms_median": statistics.median(ms["arena"]),
            "arena_over_own": statistics.median(ratios),
            "arena_over_own_range": [min(ratios), max(ratios)], "own_ms": ms["own"],
            "arena_ms": ms["arena"]}
        r = out["formats"][fmt]
        print(f"{fmt}: decode per token, own {r['own_ms_median']:.3f} ms, arena "
              f"{r['arena_ms_median']:.3f} ms; arena / own, median of {args.pairs} pairs "
              f"{r['arena_over_own']:.3f} ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
        del llms
    print("wrote", write_result("weight_arena_ab", out))


if __name__ == "__main__":
    main()
