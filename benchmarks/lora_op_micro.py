"""Micro-benchmark: the LoRA ops of one decode step, SmolLM2-135M shapes, float32.

B decode tokens spread evenly over N adapters (ranks spaced 8..64, all 7 modules), 4 groups x
30 layers of LoRA ops per step. Variants, timed as medians of interleaved runs:
  segments/auto|fused|split  lora.ops.apply_lora with each expand policy of the slot pool
  gather-bmm                 per-token gather of A/B from the pool (copies), then two bmm
  seg-view-bmm               one bmm pair over equal segments on pool *views*; only possible
                             when the batch's slots are a contiguous range, padded to the
                             batch's max rank: an upper bound for the bmm idea, not a kernel
  base linears / lm_head     the base model's matmuls of the same step, for scale

    .venv/bin/python benchmarks/lora_op_micro.py [--tokens 64 --adapters 16 --reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from loraserve.adapters.format import LoraAdapterWeights, LoraModuleWeights
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.config import LORA_MODULES, ModelConfig
from loraserve.lora.batch import LoraBatch
from loraserve.lora.layout import GROUP_NAMES
from loraserve.lora.ops import apply_lora

SMOLLM2 = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    name="smollm2-135m-shapes",
)


def synthetic_adapter(cfg: ModelConfig, rank: int, seed: int) -> LoraAdapterWeights:
    # one random tensor per module shape, shared by layers as views: the pool copies it into
    # its own memory per layer, so traffic in the timed ops is realistic
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for m in LORA_MODULES:
        d_out, d_in = cfg.module_shape(m)
        A = torch.randn(rank, d_in, generator=g) * 0.02
        B = torch.randn(d_out, rank, generator=g) * 0.02
        mods[m] = LoraModuleWeights(A=A, B=B, rank=rank, scale=1.0)
    layers = tuple(dict(mods) for _ in range(cfg.num_hidden_layers))
    return LoraAdapterWeights(f"synthetic-{seed}", rank, frozenset(LORA_MODULES), layers, 0, "")


def gather_bmm(pool, xs, ys, token_slots, batch) -> None:
    idx = torch.tensor(token_slots)
    for layer in range(pool.model_config.num_hidden_layers):
        for g in GROUP_NAMES:
            r = max(ranks[g] for ranks in batch.ranks.values())
            A_tok = pool.A[layer][g][idx, :r]  # A_tok: [T, r, d_in] (a copy)
            B_tok = pool.B[layer][g][idx, :r]  # B_tok: [T, r, d_out] (a copy)
            t = torch.bmm(xs[g].unsqueeze(1), A_tok.transpose(1, 2))  # t: [T, 1, r]
            ys[g].unsqueeze(1).baddbmm_(t, B_tok)


def seg_view_bmm(pool, xs, ys, n_seg, batch) -> None:
    for layer in range(pool.model_config.num_hidden_layers):
        for g in GROUP_NAMES:
            r = max(ranks[g] for ranks in batch.ranks.values())
            x = xs[g].view(n_seg, -1, xs[g].shape[1])  # x: [N, n, d_in]
            y = ys[g].view(n_seg, -1, ys[g].shape[1])
            t = torch.bmm(x, pool.A[layer][g][:n_seg, :r].transpose(1, 2))  # t: [N, n, r]
            y.baddbmm_(t, pool.B[layer][g][:n_seg, :r])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-rank", type=int, default=8)
    ap.add_argument("--max-rank", type=int, default=64)
    ap.add_argument("--no-gather", action="store_true", help="skip the (slow) gather-bmm form")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg, T, N = SMOLLM2, args.tokens, args.adapters
    if T % N:
        raise SystemExit("--tokens must be a multiple of --adapters")
    lo, hi = args.min_rank, args.max_rank
    ranks = [round(lo + k * (hi - lo) / max(N - 1, 1)) for k in range(N)]
    pool = LoraSlotPool(cfg, N, hi)
    for s, r in enumerate(ranks):
        pool.write(s, synthetic_adapter(cfg, r, s))
    seqs = [(s, 1) for s in range(N) for _ in range(T // N)]  # one token per decoding sequence
    batches = {}
    for policy in ("auto", "fused", "split"):
        pool.set_expand(policy)
        batches[policy] = LoraBatch.build(seqs, pool)
    batch = batches["auto"]
    token_slots = batch.token_slots()
    lays = pool.layouts
    xs = {g: torch.randn(T, lay.d_in) for g, lay in lays.items()}  # x: [T, d_in]
    ys = {g: torch.zeros(T, lay.d_out) for g, lay in lays.items()}  # y: [T, d_out_g]
    W = [
        {g: torch.randn(lay.d_out, lay.d_in) * 0.02 for g, lay in lays.items()}
        for _ in range(cfg.num_hidden_layers)
    ]
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02

    def segments(policy):
        b = batches[policy]
        return lambda: [
            apply_lora(xs[g], ys[g], pool.A[layer][g], pool.B[layer][g], b, g)
            for layer in range(cfg.num_hidden_layers)
            for g in GROUP_NAMES
        ]

    variants = {f"segments/{p}": segments(p) for p in ("auto", "fused", "split")}
    if not args.no_gather:
        variants["gather-bmm"] = lambda: gather_bmm(pool, xs, ys, token_slots, batch)
    variants["seg-view-bmm"] = lambda: seg_view_bmm(pool, xs, ys, N, batch)
    variants["base linears"] = lambda: [
        F.linear(xs[g], W[layer][g]) for layer in range(cfg.num_hidden_layers) for g in GROUP_NAMES
    ]
    variants["lm_head"] = lambda: F.linear(xs["o"], lm_head)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for f in variants.values():
        f()  # warm-up
    for _ in range(args.reps):
        for name, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    lora_mib = sum(r * sum(sum(cfg.module_shape(m)) for m in LORA_MODULES) for r in ranks)
    lora_mib *= cfg.num_hidden_layers * 4 / 2**20
    print(
        f"SmolLM2-135M shapes, {T} decode tokens over {N} adapters, ranks {ranks[0]}..{ranks[-1]}"
        f", all 7 modules; {torch.get_num_threads()} threads; {args.reps} interleaved reps"
    )
    print(f"LoRA weights the batch needs: {lora_mib:.0f} MiB; pool: {pool.nbytes / 2**20:.0f} MiB")
    for name, ts in times.items():
        print(
            f"  {name:16s} median {statistics.median(ts) * 1e3:8.1f} ms/step   "
            f"min {min(ts) * 1e3:8.1f}"
        )


if __name__ == "__main__":
    main()
