"""Prefill attention: the C kernel (model/attention/prefill_attention.c) against the torch path
it replaces, side by side in one process, rounds alternating.

- `kernel`: SmolLM2-135M's heads (9 query / 3 kv of 64), one layer's attention of a prompt
  chunk: fresh prompts (torch: SDPA, causal, on the step's rows) and chunks over a cached
  context (torch: the context gathered from the paged cache, SDPA with a mask), as the CPU
  backend calls either. Per shape: microseconds a call, median of the per-round ratios.
- `engine`: the bundled model on 32 concurrent prompts of 128 tokens, 64 tokens out each
  (the 32-concurrent workload of vs_llamacpp.py, offline), with the kernel on and off in the
  same engine (rounds alternating); output tokens per second, and the greedy tokens of the
  two sides compared.

    .venv/bin/python benchmarks/prefill_attention.py kernel --rounds 9
    .venv/bin/python benchmarks/prefill_attention.py engine --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from loraserve.model.attention import cpu as cpu_attention
from loraserve.model.attention.prefill_attention import load, prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = ((23, 23), (105, 105), (128, 128), (16, 128), (112, 128), (512, 512), (256, 1024))


def kernel_sides(t: int, ctx: int):
    """(C call, torch call, multiply-adds) for a chunk of t rows ending a context of ctx."""
    g = torch.Generator().manual_seed(t * 7 + ctx)
    qkv = torch.randn(t, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=g)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    out = torch.empty(t, HEADS, HEAD_DIM)
    lib, scale = load(), HEAD_DIM ** -0.5
    nb = -(-ctx // BLOCK)
    k_cache = torch.randn(4 * nb * BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(4 * nb, generator=g)[:nb]
    qs = q.transpose(0, 1).unsqueeze(0)
    if t == ctx:  # a fresh prompt
        def c_side():
            prefill_attention(lib, q, out, ctx, k, v, None, BLOCK, scale)

        def torch_side():
            ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
            out.copy_(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                     enable_gqa=True).squeeze(0).transpose(0, 1))
    else:
        mask = cpu_attention._causal_mask(t, ctx, 0, 0, q.device)

        def c_side():
            prefill_attention(lib, q, out, ctx, k_cache, v_cache, table, BLOCK, scale)

        def torch_side():
            ks = cpu_attention._gather(k_cache, table, BLOCK)[:ctx].transpose(0, 1).unsqueeze(0)
            vs = cpu_attention._gather(v_cache, table, BLOCK)[:ctx].transpose(0, 1).unsqueeze(0)
            out.copy_(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                     enable_gqa=True).squeeze(0).transpose(0, 1))
    # causal: row i sees ctx - t + i + 1 tokens; a score and a weighted V row per token
    macs = sum(ctx - t + i + 1 for i in range(t)) * HEADS * HEAD_DIM * 2
    return c_side, torch_side, macs


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def run_kernel(args) -> None:
    if load() is None:
        sys.exit("the prefill attention kernel did not build")
    torch.set_num_threads(args.threads)
    print("| chunk rows, context | C us | torch us | torch / C (per-round range) | C GMAC/s |")
    print("|---|---|---|---|---|")
    for t, ctx in SHAPES:
        c_side, torch_side, macs = kernel_sides(t, ctx)
        reps = max(3, int(2e7 / macs))
        c, tr = [], []
        for r in range(args.rounds):
            pair = [(c, c_side), (tr, torch_side)]
            for acc, fn in pair if r % 2 == 0 else pair[::-1]:
                acc.append(timed(fn, reps))
        ratios = [b / a for a, b in zip(c, tr, strict=True)]
        mc = statistics.median(c)
        print(f"| {t}, {ctx} | {mc * 1e6:.0f} | {statistics.median(tr) * 1e6:.0f} | "
              f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{macs / mc / 1e9:.0f} |")


def run_engine(args) -> None:
    from loraserve.engine.llm import LLM
    from loraserve.types import SamplingParams

    # no prefix cache: every round computes its prompts
    llm = LLM(None, num_threads=args.threads, quantization=args.quantization,
              enable_prefix_caching=False)
    attention = llm.engine.runner.attention
    kernel = attention.prefill_kernel
    if kernel is None:
        sys.exit("the prefill attention kernel did not build")
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 49152) for _ in range(128)] for _ in range(32)]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    rates: dict[str, list[float]] = {"C": [], "torch": []}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for side in ("C", "torch") if r % 2 == 0 else ("torch", "C"):
            attention.prefill_kernel = kernel if side == "C" else None
            start = time.perf_counter()
            outs = llm.generate(prompts, sp)
            rates[side].append(sum(len(o.token_ids) for o in outs)
                               / (time.perf_counter() - start))
            tokens[side] = [o.token_ids for o in outs]
    ratios = [a / b for a, b in zip(rates["C"], rates["torch"], strict=True)]
    same = sum(a == b for a, b in zip(tokens["C"], tokens["torch"], strict=True))
    print(f"output tok/s C {statistics.median(rates['C']):.1f}, torch "
          f"{statistics.median(rates['torch']):.1f}: C / torch **{statistics.median(ratios):.3f}**"
          f" ({min(ratios):.3f}-{max(ratios):.3f}) over {args.rounds} rounds; greedy tokens "
          f"equal for {same} of {len(prompts)} prompts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernel", help="one layer's attention per chunk shape")
    k.add_argument("--rounds", type=int, default=9)
    k.add_argument("--threads", type=int, default=2)
    e = sub.add_parser("engine", help="32 concurrent prompts, the kernel on and off")
    e.add_argument("--rounds", type=int, default=5)
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--quantization", default="none")
    args = ap.parse_args()
    run_kernel(args) if args.what == "kernel" else run_engine(args)


if __name__ == "__main__":
    main()
