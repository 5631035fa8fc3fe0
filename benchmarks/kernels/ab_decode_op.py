"""the interleaved decode op (lora/gemm_lora_decode_cpu.c): a decode step's projections

Every projection of one decode step on SmolLM2 shapes with its LoRA work (16 adapters of ranks
8/16/32/64 on all seven modules, the step's tokens spread evenly), and the GEMMs alone; per
group of projections, each side's median and the median over rounds of B - A. The source
includes headers from ops/ and lora/ (ops/gemm_tile.h, lora/fused_tile.h, ...) resolved
beside it, so an older revision is compared from a worktree of it
(`git worktree add /tmp/old REV`).

--engine: whole runs of multi_lora.py's workload in the engine (64 requests, 128 in, 64 out,
over 16 adapters), the engine's decode op switched between A and B run by run, base-only runs
between: each side's multi/base, and the per-round B - A for the run and its decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import StepTimes, mixed_adapter_workload, time_ours
from fused_lora import RANKS, smollm2_step, time_groups
from kernel_ab import add_sides, alternate, median_diff

from loraserve.lora import gemm_lora_cpu
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend
from loraserve.lora.layout import GROUP_NAMES
from loraserve.ops import cbuild


def add_args(ap: argparse.ArgumentParser) -> None:
    add_sides(ap, gemm_lora_cpu.DECODE_SOURCE, rounds=31)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--engine", action="store_true", help="whole engine runs (see above)")


def run(args: argparse.Namespace) -> None:
    libs = {side: cbuild.load_library_once(getattr(args, side).resolve(),
                                           getattr(args, f"{side}_flags").split(), side.upper(),
                                           gemm_lora_cpu._configure_decode)
            for side in ("a", "b")}
    if None in libs.values():
        sys.exit("a side did not build (or this CPU lacks AVX2 + FMA)")
    if args.engine:
        engine_runs(libs, args.rounds)
        return
    n = args.adapters
    backend, per, linears, xs = smollm2_step(n, args.tokens)
    plans = {}
    for side, lib in libs.items():  # a plan's DecodeCalls hold the library they were made with
        backend.decode_lib = lib
        plans[side] = backend.plan([(s, per) for s in range(n)])

    def step(side: str) -> dict[str, float]:
        if side == "gemm":
            return time_groups(linears, xs, lambda layer, name, x, lin: lin(x))
        return time_groups(linears, xs, lambda layer, name, x, lin:
                           backend.project(plans[side], layer, name, x, lin))

    res = alternate(step, ("a", "b", "gemm"), args.rounds)
    gemms = statistics.median(t["step"] for t in res["gemm"])
    print(f"{args.tokens} tokens over {n} adapters, {args.threads} threads, {args.rounds} "
          f"rounds; GEMMs alone {1e3 * gemms:.1f} ms a step")
    for part in ("step", *GROUP_NAMES):
        a, b = ([t[part] for t in res[side]] for side in ("a", "b"))
        med_a, med_b = statistics.median(a), statistics.median(b)
        print(f"  {part:8s} A {1e3 * med_a:7.2f}  B {1e3 * med_b:7.2f}  "
              f"B - A (median of rounds) {1e3 * median_diff(a, b):+6.2f} ms")


def engine_runs(libs: dict, rounds: int) -> None:
    """Whole multi-LoRA runs in the engine with each side's decode op, and base-only runs;
    the decode steps' time is printed apart (the op runs only there; prefill steps are the
    noisier part of a run)."""
    llm, prompts, loras = mixed_adapter_workload("loraserve-decode-op-ab-", ranks=RANKS)
    backend = llm.engine.runner.lora
    if not isinstance(backend, CpuKernelLoraBackend):
        sys.exit(f"the engine runs the {type(backend).__name__}, not the C kernel")
    steps = StepTimes()

    def one_run(side: str) -> tuple[float, float]:
        if side != "base":
            backend.decode_lib = libs[side]  # read by each step's plan
        steps.clear()
        total = time_ours(llm, prompts, 64, None if side == "base" else loras)
        return total, steps.split()[1]

    res = alternate(one_run, ("a", "b", "base"), rounds, warm_up=False)  # warmed up already
    base = statistics.median(total for total, _ in res["base"])
    for side in ("a", "b"):
        total = statistics.median(t for t, _ in res[side])
        dec = statistics.median(d for _, d in res[side])
        print(f"{side.upper()}: {total:.3f} s a run (decode steps {dec:.3f} s), "
              f"multi/base {base / total:.3f}")
    for j, what in enumerate(("run", "decode steps")):
        a, b = ([r[j] for r in res[side]] for side in ("a", "b"))
        rounds_d = " ".join(f"{y - x:+.2f}" for x, y in zip(a, b, strict=True))
        print(f"B - A, {what}: median of rounds {median_diff(a, b):+.3f} s (rounds: {rounds_d})")
    print(f"base-only {base:.3f} s a run")
