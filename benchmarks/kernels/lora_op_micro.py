"""Micro-benchmark: the LoRA ops of one decode step, SmolLM2-135M shapes, float32.

B decode tokens spread evenly over N adapters (ranks spaced 8..64, all 7 modules), 4 groups x
30 layers of LoRA ops per step. Variants, timed as medians of interleaved runs:
  c-kernel        the `cpu` LoRA backend (the C kernel, lora/sgmv_cpu.c): the engine's default
  torch-onednn    the `torch` backend: one shrink and one expand matmul per segment and
                  module, on views of the slot pool (Punica-style), through oneDNN
  torch-segments  the same through torch.mm (MKL): the path where oneDNN is missing
  gather-bmm      per-token gather of A (copies), then bmm: the naive batched form
  base linears / lm_head   the base model's matmuls of the same step (oneDNN), for scale

    .venv/bin/python benchmarks/kernels/lora_op_micro.py [--tokens 64 --adapters 16 --reps 5]
        [--variants "c-kernel,base linears"]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loraserve.adapters.format import LoraAdapterWeights, LoraModuleWeights
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.config import LORA_MODULES, ModelConfig
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend
from loraserve.lora.backends.torch_matmul import TorchLoraBackend
from loraserve.lora.layout import GROUP_NAMES, a_tiles
from loraserve.model.linear import Linear

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


def gather_bmm_shrink(pool, xs, token_slots, batch) -> None:
    # Only the shrink half: already slower than the whole c-kernel op.
    idx = torch.tensor(token_slots)
    for layer in range(pool.model_config.num_hidden_layers):
        for g in GROUP_NAMES:
            r, d_in = max(ranks[g] for ranks in batch.ranks.values()), xs[g].shape[1]
            for _, w, off in a_tiles(r, d_in):  # the widest rank's A.T tiles
                A_tok = pool.A[layer][g][idx, off : off + d_in * w].view(-1, d_in, w)  # a copy
                torch.bmm(xs[g].unsqueeze(1), A_tok)  # [T, 1, w]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-rank", type=int, default=8)
    ap.add_argument("--max-rank", type=int, default=64)
    ap.add_argument("--lora-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="slot pool dtype (the engine's lora_dtype)")
    ap.add_argument("--variants", default="", help="comma-separated names to run (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg, T, N = SMOLLM2, args.tokens, args.adapters
    if T % N:
        raise SystemExit("--tokens must be a multiple of --adapters")
    lo, hi = args.min_rank, args.max_rank
    ranks = [round(lo + k * (hi - lo) / max(N - 1, 1)) for k in range(N)]
    dtype = getattr(torch, args.lora_dtype)
    pool = LoraSlotPool(cfg, N, hi, dtype=dtype)
    for s, r in enumerate(ranks):
        pool.write(s, synthetic_adapter(cfg, r, s))
    seqs = [(s, 1) for s in range(N) for _ in range(T // N)]  # one token per decoding sequence
    torch_mkl = TorchLoraBackend(pool)
    torch_mkl.onednn = False
    torch_onednn = TorchLoraBackend(pool)
    torch_onednn.onednn = True
    backends = {"c-kernel": CpuKernelLoraBackend(pool), "torch-onednn": torch_onednn,
                "torch-segments": torch_mkl}
    plans = {name: b.plan(seqs) for name, b in backends.items()}
    batch = plans["torch-segments"].batch
    token_slots = batch.token_slots()
    lays = pool.layouts
    xs = {g: torch.randn(T, lay.d_in) for g, lay in lays.items()}  # x: [T, d_in]
    ys = {g: torch.zeros(T, lay.d_out) for g, lay in lays.items()}  # y: [T, d_out_g]
    W = [
        {g: Linear(torch.randn(lay.d_out, lay.d_in) * 0.02) for g, lay in lays.items()}
        for _ in range(cfg.num_hidden_layers)
    ]
    lm_head = Linear(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02)

    def segments(name):
        b, plan = backends[name], plans[name]
        return lambda: [
            b.apply(plan, layer, g, xs[g], ys[g])
            for layer in range(cfg.num_hidden_layers)
            for g in GROUP_NAMES
        ]

    variants = {name: segments(name) for name in backends}
    variants["gather-bmm shrink"] = lambda: gather_bmm_shrink(pool, xs, token_slots, batch)
    variants["base linears"] = lambda: [
        W[layer][g](xs[g]) for layer in range(cfg.num_hidden_layers) for g in GROUP_NAMES
    ]
    variants["lm_head"] = lambda: lm_head(xs["o"])
    if args.variants:
        keep = args.variants.split(",")
        variants = {k: f for k, f in variants.items() if k in keep}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for f in variants.values():
        f()  # warm-up
    for _ in range(args.reps):
        for name, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    lora_mib = sum(r * sum(sum(cfg.module_shape(m)) for m in LORA_MODULES) for r in ranks)
    lora_mib *= cfg.num_hidden_layers * pool.A[0]["qkv"].element_size() / 2**20
    print(
        f"SmolLM2-135M shapes, {T} decode tokens over {N} adapters, ranks {ranks[0]}..{ranks[-1]}"
        f", all 7 modules; {torch.get_num_threads()} threads; {args.reps} interleaved reps"
    )
    print(f"LoRA weights the batch needs: {lora_mib:.0f} MiB; pool: {pool.nbytes / 2**20:.0f} MiB")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:16s} median {med * 1e3:8.1f} ms/step   min {min(ts) * 1e3:8.1f}"
            f"   ({lora_mib * 2**20 / med / 1e9:5.1f} GB/s of LoRA weights)"
        )


if __name__ == "__main__":
    main()
