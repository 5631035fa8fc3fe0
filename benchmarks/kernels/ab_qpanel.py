"""the quantized panel GEMM (ops/qpanel_gemm.c): a model's weight stream, at batch 1 or more

Every projection of a model's layers (the bundled SmolLM2-135M's shapes, or SmolLM2-360M's),
packed as the engine packs them (one after another in the weight arena), multiplied by
`--rows` rows of x back to back: at one row, what a batch-1 decode token streams. Effective
GB/s = the weights' bytes (quants and scales) / time, against the host's copy rate measured
between rounds; the product's floor at one row is that copy rate. With more rows (a batched
decode step, a prefill chunk) the product is bound by arithmetic: GMAC/s is printed too.
Both sides must give the same bits (a fetch hint or a tile change does not change the
arithmetic): the largest difference is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

import torch
from kernel_ab import add_sides, alternate, median_ratio
from memory_floor import SHAPES, copy_gbs

from loraserve.model.bundled import default_model_dir
from loraserve.ops import qpanel
from loraserve.ops.cbuild import load_library_once
from loraserve.ops.quant_formats import quantize_int4, quantize_int8

MODELS = ("smollm2-135m", *SHAPES)  # the bundled model's config, or memory_floor.py's shapes
FORMATS = {"int8": quantize_int8, "int4": quantize_int4}


def add_args(ap: argparse.ArgumentParser) -> None:
    add_sides(ap, qpanel._SOURCE, rounds=12)
    ap.add_argument("--model", default="smollm2-360m", choices=MODELS)
    ap.add_argument("--rows", type=int, default=1, help="rows of x per product")


def projection_shapes(model: str) -> tuple[list[tuple[int, int]], int]:
    """(out, in) of a layer's qkv, o, gate_up and down, and the number of layers."""
    c = (json.loads((default_model_dir() / "config.json").read_text())
         if model == "smollm2-135m" else SHAPES[model])
    d, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return [(q + 2 * kv, d), (d, q), (2 * inter, d), (d, inter)], c["num_hidden_layers"]


def stream_time(libs, weights, xs, outs, work, side: str) -> float:
    """Seconds for side's kernel over every weight, all of x's rows each."""
    lib, y = libs[side], outs[side]
    t = time.perf_counter()
    for i, p in enumerate(weights):
        k = p.in_features
        lib.qpanel_gemm(qpanel.PANEL_KINDS[p.kind], xs[k].data_ptr(), k, xs[k].shape[0], k,
                        p.w.data_ptr(),
                        p.d.data_ptr(), None if p.m is None else p.m.data_ptr(),
                        p.out_features, y[i].data_ptr(), p.out_features, work.data_ptr(),
                        torch.get_num_threads())
    return time.perf_counter() - t


def after_copy(measure, copies: list, side: str) -> float:
    """The host's copy rate now (into `copies`), then side's time."""
    copies.append(copy_gbs(reps=2))
    return measure(side)


def run(args: argparse.Namespace) -> None:
    libs = {side: load_library_once(getattr(args, side).resolve(),
                                    getattr(args, f"{side}_flags").split(), side.upper(),
                                    qpanel._configure)
            for side in "ab"}
    if None in libs.values():
        sys.exit("a side did not build (or this CPU has neither AVX-512 VNNI nor AVX2)")
    shapes, layers = projection_shapes(args.model)
    torch.manual_seed(0)
    xs = {k: torch.randn(args.rows, k) for _, k in shapes}
    work = torch.empty(max(1 << 20, args.rows * (max(xs) * 2 + 64)), dtype=torch.uint8)
    copies = []
    for name, quantize in FORMATS.items():
        weights = [qpanel.pack_panels(quantize(torch.randn(n, k) * 0.02))
                   for _ in range(layers) for n, k in shapes]
        outs = {side: [torch.empty(args.rows, p.out_features) for p in weights]
                for side in libs}
        measure = partial(stream_time, libs, weights, xs, outs, work)
        times = alternate(partial(after_copy, measure, copies), ("a", "b"), args.rounds)
        gb = sum(p.nbytes for p in weights) / 1e9
        gmac = args.rows * sum(p.in_features * p.out_features for p in weights) / 1e9
        med = {side: statistics.median(ts) for side, ts in times.items()}
        diff = max((ya - yb).abs().max().item() for ya, yb in zip(outs["a"], outs["b"],
                                                                  strict=True))
        print(f"{name} {gb * 1e3:.0f} MB: " + "  ".join(
            f"{side} {m * 1e3:6.3f} ms ({gb / m:5.1f} GB/s, {gmac / m:5.1f} GMAC/s)"
            for side, m in med.items())
            + f"  b/a (median of rounds) {median_ratio(times['b'], times['a']):.3f}x"
            f"  max diff {diff:.1e}", flush=True)
    print(f"copy rate between rounds: median {statistics.median(copies):.1f} GB/s, "
          f"best {max(copies):.1f}")
