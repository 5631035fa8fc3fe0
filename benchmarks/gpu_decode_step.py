"""Batch-1 decode on a GPU, replayed from CUDA graphs, with the element-wise steps as Triton
kernels (ops/triton_elementwise.py) against torch's ops: time per token, and what the torch
profiler sees in a step (kernels launched, their summed device time, the rest of the wall
time: the host's share between replays). Then, on each side, a replayed decode step of 64
sequences over 16 adapters (r8-64, all modules) and one of 64 base-only sequences through the
same profiler: where a mixed step spends the time a base-only one does not (the LoRA shrink
and expand kernels by name); on the Triton side also for each shape of the expand programs
in EXPAND_VARIANTS, and the one whose LoRA kernels took the least device time (`best_expand`,
which gpu_check.sh hands to the benchmarks after it).

One engine on the Llama-3.2-1B-shaped model of gpu_serving.py (bf16, random weights); the two
sides alternate in one process (`LORASERVE_FUSED_GPU` off / on, the decode graphs recorded
again for each side), ABAB, so a drifting clock or a neighbour touches both.

    PYTHONPATH=. python benchmarks/gpu_decode_step.py [--json FILE]    # on the GPU machine
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_decode_step.py --smoke  # the script, CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import random_llama, scratch_dir  # noqa: E402
from gpu_serving import (  # noqa: E402
    LLAMA_1B,
    SMOKE,
    copy_rate_gbs,
    set_lora_expand,
    sync,
    time_loraserve,
)

from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.engine.cuda_graphs import ReplayEmulator  # noqa: E402
from loraserve.ops.elementwise import set_gpu_enabled  # noqa: E402


def per_token_ms(llm: LLM, prompt: list[int], tokens: int) -> float:
    return 1e3 * time_loraserve(llm, [prompt], tokens) / tokens


def profiled(run, per: int, device: str) -> dict:
    """run() under the torch profiler: kernels, their device time and the wall time, each
    divided by `per` (tokens or steps), and the top kernels by device time (ms, count)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        run()
        sync(device)
        wall = time.perf_counter() - t
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        ms_count = by_name.setdefault(e.name[:90], [0.0, 0])
        ms_count[0] += e.time_range.elapsed_us() / 1e3 / per
        ms_count[1] += 1 / per
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:14]
    return {"kernels": len(kernels) / per, "wall_ms": 1e3 * wall / per,
            "device_ms": sum(ms for ms, _ in by_name.values()),
            "top_kernels_ms_count": dict(top)}


def profile_step(llm: LLM, prompt: list[int], tokens: int) -> dict:
    """Per decode token of one sequence."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return profiled(lambda: llm.generate([prompt], params), tokens, llm.engine.device.type)


def profile_mixed_step(llm: LLM, names: list[str | None], seqs: int, steps: int) -> dict:
    """Per decode step of `seqs` sequences spread over the adapters `names` ([None]: the
    base model alone), the prompts' prefill done before the profiler starts."""
    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(list(range(200 + i, 232 + i)), params, names[i % len(names)])
            for i in range(seqs)]
    while not all(r.output_token_ids for r in reqs):
        eng.step()

    def replays() -> int:
        return sum(g.replays for g in eng.runner.graphs.graphs.values())

    before = replays()

    def decode() -> None:
        for _ in range(steps):
            eng.step()

    res = profiled(decode, steps, eng.device.type)
    res["replayed_steps"] = replays() - before
    while eng.has_work:
        eng.step()
    return res


EXPAND_VARIANTS = ((1, 16), (1, 32), (1, 64))  # (strips, rank step)


def load_kernels(path: str):
    """The Triton LoRA kernels from another source file (an earlier version, to compare in
    the same process); an expand launcher without the rank step's argument is given one."""
    spec = importlib.util.spec_from_file_location("lora_kernels_" + Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if "max_lora_rank" not in inspect.signature(mod.launch_expand).parameters:
        launch = mod.launch_expand
        mod.launch_expand = lambda *args: launch(*args[:6])
    return mod


def expand_variants(llm: LLM, names: list[str], seqs: int, device: str,
                    other_kernels: str | None) -> dict:
    """The mixed step again for each (column strips per expand program, rank rows per step of
    its reduction) in EXPAND_VARIANTS (lora/triton_sgmv.EXPAND_STRIPS, EXPAND_RANK_BLOCK),
    and with the kernels of `other_kernels` (a source file) at their defaults, graphs recorded
    again for each, the defaults restored after; and the variant of ours whose LoRA kernels
    took the least device time."""
    from loraserve.lora import triton_sgmv

    backend = llm.engine.runner.lora
    default, out = (triton_sgmv.EXPAND_STRIPS, triton_sgmv.EXPAND_RANK_BLOCK), {}
    variants = [(f"{a},{b}", triton_sgmv) for a, b in EXPAND_VARIANTS]
    if other_kernels:
        variants.append((Path(other_kernels).name, load_kernels(other_kernels)))
    try:
        for label, kernels in variants:
            backend.kernels = kernels
            if kernels is triton_sgmv:
                set_lora_expand(label)
            llm.engine.runner.enable_decode_graphs(
                seqs, llm.engine.max_model_len, None if device == "cuda" else ReplayEmulator)
            res = profile_mixed_step(llm, names, seqs, 8)
            res["lora_ms"] = sum(ms for k, (ms, _) in res["top_kernels_ms_count"].items()
                                 if k.startswith("sgmv_"))
            out[label] = res
            print("LoRA kernels", label, f"{res['lora_ms']:.3f} ms/step,",
                  {k: round(ms, 3) for k, (ms, _) in res["top_kernels_ms_count"].items()
                   if k.startswith("sgmv_")}, f"step {res['wall_ms']:.3f} ms", flush=True)
    finally:
        backend.kernels = triton_sgmv
        set_lora_expand(",".join(map(str, default)))
        llm.engine.runner.enable_decode_graphs(
            seqs, llm.engine.max_model_len, None if device == "cuda" else ReplayEmulator)
    ours = [label for label, kernels in variants if kernels is triton_sgmv and label in out]
    return {"mixed_step_expand": out,
            "best_expand": min(ours, key=lambda k: out[k]["lora_ms"]) if ours else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--sides", default="torch,triton",
                    help="which element-wise sides to run (torch, triton or both)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--other-lora-kernels", default=None, metavar="FILE",
                    help="another triton_sgmv.py (an earlier version) to profile beside ours")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random Llama on the CPU, graphs emulated: the script only")
    args = ap.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    if args.smoke:
        args.tokens, args.pairs = 8, 1
    work = scratch_dir("loraserve-gpu-decode-")
    model_dir = random_llama(SMOKE if args.smoke else LLAMA_1B, work / "model", dtype,
                             args.tokenizer)
    cpu = {"attention_backend": "triton", "lora_backend": "triton"} if args.smoke else {}
    paths = make_synthetic_adapters(model_dir, work, 4 if args.smoke else 16,
                                    ranks=(4, 8) if args.smoke else (8, 16, 32, 64))
    names = [p.name for p in paths]
    seqs = 4 if args.smoke else 64
    llm = LLM(model_dir, device=device, dtype=str(dtype).removeprefix("torch."),
              lora_paths={p.name: str(p) for p in paths}, max_loras_per_batch=len(names),
              max_lora_rank=64, enable_prefix_caching=False, cuda_graph_max_bs=seqs, **cpu)
    runner = llm.engine.runner
    prompt = list(range(100, 132))
    sides: dict[str, dict] = {name: {"ms": []} for name in args.sides.split(",")}
    for pair in range(args.pairs):
        for name in sides:
            set_gpu_enabled(name == "triton")
            runner.enable_decode_graphs(seqs, llm.engine.max_model_len,
                                        None if device == "cuda" else ReplayEmulator)
            per_token_ms(llm, prompt, 8)  # warm-up: Triton compiles, the allocator settles
            sides[name]["ms"].append(per_token_ms(llm, prompt, args.tokens))
            if pair == 0:
                try:
                    sides[name]["profile"] = profile_step(llm, prompt, 32)
                    sides[name]["mixed_step"] = profile_mixed_step(llm, names, seqs, 8)
                    sides[name]["base_step"] = profile_mixed_step(llm, [None], seqs, 8)
                    if name == "triton":
                        sides[name].update(expand_variants(llm, names, seqs, device,
                                                           args.other_lora_kernels))
                except Exception as e:  # the timings above stand without it
                    sides[name]["profile_error"] = repr(e)
            print(name, pair, f"{sides[name]['ms'][-1]:.3f} ms/token", flush=True)
    for s in sides.values():
        s["ms_per_token"] = statistics.median(s["ms"])
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "tokens": args.tokens, "sides": sides,
           "triton_vs_torch": (sides["torch"]["ms_per_token"] / sides["triton"]["ms_per_token"]
                               if len(sides) == 2 else None)}
    if device == "cuda":
        res["copy_rate_gbs"] = copy_rate_gbs(device)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
