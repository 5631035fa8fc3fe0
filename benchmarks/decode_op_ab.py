"""A/B two builds of the interleaved decode op (lora/gemm_lora_decode_cpu.c) in one process,
alternating round by round: every projection of one decode step on SmolLM2 shapes with its
LoRA ops (16 adapters of ranks 8/16/32/64 on all seven modules, the step's tokens spread
evenly), and the GEMMs alone.

Each side is a source file and extra compiler flags. The source #includes ../ops/gemm_cpu.c
and sgmv_cpu.c beside it, so an older revision is compared from a worktree of it:

    git worktree add /tmp/old REV; OLD=/tmp/old/loraserve/lora/gemm_lora_decode_cpu.c
    .venv/bin/python benchmarks/decode_op_ab.py --a-src $OLD [--tokens 64] [--rounds 31]
    .venv/bin/python benchmarks/decode_op_ab.py --b-flags=-DSOME_SWITCH=1

Prints each side's median step time and the median over rounds of B - A, per group of
projections (the host drifts: the per-round difference is the figure to quote).

`--engine` times whole runs of multi_lora.py's workload in the engine instead (64 requests,
128 in, 64 out, over 16 adapters), the engine's decode op switched between A and B run by run,
with base-only runs between: each side's multi/base and the per-round B - A in seconds, for
the whole run and for its decode steps alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import StepTimes, mixed_adapter_workload, time_ours  # noqa: E402
from fused_lora import RANKS, smollm2_step, time_groups  # noqa: E402

from loraserve.lora import gemm_lora_cpu  # noqa: E402
from loraserve.lora.backends.cpu_kernel import CpuKernelLoraBackend  # noqa: E402
from loraserve.lora.layout import GROUP_NAMES  # noqa: E402
from loraserve.ops import cbuild  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-src", type=Path, default=gemm_lora_cpu.DECODE_SOURCE)
        ap.add_argument(f"--{side}-flags", default="", help="extra compiler flags")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="store_true", help="whole engine runs (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {side: cbuild.load_library_once(getattr(args, f"{side}_src").resolve(),
                                           getattr(args, f"{side}_flags").split(), side.upper(),
                                           gemm_lora_cpu._configure_decode)
            for side in ("a", "b")}
    if None in libs.values():
        sys.exit("a side did not build (or this CPU lacks AVX2 + FMA)")
    if args.engine:
        engine_ab(libs, args.rounds)
        return
    n = args.adapters
    backend, per, linears, xs = smollm2_step(n, args.tokens)
    plans = {}
    for side, lib in libs.items():  # a plan's DecodeCalls hold the library they were made with
        backend.decode_lib = lib
        plans[side] = backend.plan([(s, per) for s in range(n)])

    def step(side: str | None) -> dict[str, float]:
        if side is None:
            return time_groups(linears, xs, lambda layer, name, x, lin: lin(x))
        return time_groups(linears, xs, lambda layer, name, x, lin:
                           backend.project(plans[side], layer, name, x, lin))

    for side in ("a", "b", None):
        step(side)  # builds, first touches
    res: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    gemms = []
    for r in range(args.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            res[side].append(step(side))
        gemms.append(step(None)["step"])
    print(f"{args.tokens} tokens over {n} adapters, {args.threads} threads, {args.rounds} "
          f"rounds; GEMMs alone {1e3 * statistics.median(gemms):.1f} ms a step")
    for part in ("step", *GROUP_NAMES):
        a = statistics.median(t[part] for t in res["a"])
        b = statistics.median(t[part] for t in res["b"])
        d = statistics.median(y[part] - x[part] for x, y in zip(res["a"], res["b"], strict=True))
        print(f"  {part:8s} A {1e3 * a:7.2f}  B {1e3 * b:7.2f}  B - A (median of rounds) "
              f"{1e3 * d:+6.2f} ms")


def engine_ab(libs: dict, rounds: int) -> None:
    """Whole multi-LoRA runs in the engine with each side's decode op, and base-only runs;
    the decode steps' time is printed apart (the op runs only there; prefill steps are the
    noisier part of a run)."""
    llm, prompts, loras = mixed_adapter_workload("loraserve-decode-op-ab-", ranks=RANKS)
    backend = llm.engine.runner.lora
    if not isinstance(backend, CpuKernelLoraBackend):
        sys.exit(f"the engine runs the {type(backend).__name__}, not the C kernel")
    steps = StepTimes()
    res: dict[str, list[tuple[float, float]]] = {"a": [], "b": [], "base": []}  # run, decode
    for r in range(rounds):
        for side in ("a", "b", "base") if r % 2 == 0 else ("base", "b", "a"):
            if side != "base":
                backend.decode_lib = libs[side]  # read by each step's plan
            steps.clear()
            run = time_ours(llm, prompts, 64, None if side == "base" else loras)
            res[side].append((run, steps.split()[1]))
    base = statistics.median(run for run, _ in res["base"])
    for side in ("a", "b"):
        run = statistics.median(run for run, _ in res[side])
        dec = statistics.median(d for _, d in res[side])
        print(f"{side.upper()}: {run:.3f} s a run (decode steps {dec:.3f} s), "
              f"multi/base {base / run:.3f}")
    for j, what in enumerate(("run", "decode steps")):
        d = [y[j] - x[j] for x, y in zip(res["a"], res["b"], strict=True)]
        print(f"B - A, {what}: median of rounds {statistics.median(d):+.3f} s "
              f"(rounds: {' '.join(f'{v:+.2f}' for v in d)})")
    print(f"base-only {base:.3f} s a run")


if __name__ == "__main__":
    main()
