"""Batch-1 decode on a GPU, replayed from CUDA graphs, with the element-wise steps as Triton
kernels (ops/triton_elementwise.py) against torch's ops: time per token, what the torch
profiler sees in a step (kernels launched, their summed device time, the rest of the wall
time: the host's share between replays), and the host's time by part of a step
(host_split). Then, on each side, a replayed decode step of 64 sequences over 16 adapters
(r8-64, all modules) and one of 64 base-only sequences through the same profiler: where a
mixed step spends the time a base-only one does not (the LoRA shrink and expand kernels by
name). benchmarks/gpu_kernel_shapes.py times the kernels' program shapes.

One engine on the Llama-3.2-1B-shaped model of gpu_serving.py (bf16, random weights); the two
sides alternate in one process (`LORASERVE_FUSED_GPU` off / on, the decode graphs recorded
again for each side), ABAB, so a drifting clock or a neighbour touches both.

    PYTHONPATH=. python benchmarks/gpu_decode_step.py [--json FILE]    # on the GPU machine
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_decode_step.py --smoke  # the script, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import random_llama, scratch_dir  # noqa: E402
from gpu_serving import LLAMA_1B, SMOKE, copy_rate_gbs, sync, time_loraserve  # noqa: E402

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


def host_split(llm: LLM, prompt: list[int], tokens: int) -> dict:
    """Where a batch-1 decode token's wall time goes on the host, median microseconds per call:
    the engine step, the runner's execute within it, the decode graphs' run (inputs filled
    and copied, replay launched: host work while the device is idle), the replay call alone,
    and sampling (which waits for the replay's logits). What a step spends outside `run` and
    `sample` is host time the device also waits for."""
    from loraserve.engine import cuda_graphs, engine, runner

    spent: dict[str, list[float]] = {}
    targets = [(engine.LLMEngine, "step", "step_us"), (runner.ModelRunner, "execute",
               "execute_us"), (cuda_graphs.DecodeGraphs, "run", "graphs_run_us"),
               (cuda_graphs.CudaGraph, "replay", "replay_us"), (runner, "sample", "sample_us")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def timed(fn, key):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.setdefault(key, []).append(1e6 * (time.perf_counter() - t))
        return call

    try:
        for (owner, name, key), (_, _, fn) in zip(targets, saved, strict=True):
            setattr(owner, name, timed(fn, key))
        per_token_ms(llm, prompt, tokens)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {k: statistics.median(v) for k, v in spent.items()}


def mixed_engine(smoke: bool, tokenizer: str | None, scratch: str
                 ) -> tuple[LLM, list[str], int]:
    """The engine these scripts time: the Llama-3.2-1B-shaped model (bf16, random weights)
    with 16 adapters r8-64 on all modules and decode graphs up to 64 sequences (`smoke`: a
    tiny float32 model on the CPU, 4 adapters, the Triton kernels interpreted); with the
    adapters' names and the mixed step's sequence count."""
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    work = scratch_dir(scratch)
    model_dir = random_llama(SMOKE if smoke else LLAMA_1B, work / "model", dtype, tokenizer)
    cpu = {"attention_backend": "triton", "lora_backend": "triton"} if smoke else {}
    paths = make_synthetic_adapters(model_dir, work, 4 if smoke else 16,
                                    ranks=(4, 8) if smoke else (8, 16, 32, 64))
    names = [p.name for p in paths]
    seqs = 4 if smoke else 64
    llm = LLM(model_dir, device=device, dtype=str(dtype).removeprefix("torch."),
              lora_paths={p.name: str(p) for p in paths}, max_loras_per_batch=len(names),
              max_lora_rank=64, enable_prefix_caching=False, cuda_graph_max_bs=seqs, **cpu)
    return llm, names, seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--sides", default="torch,triton",
                    help="which element-wise sides to run (torch, triton or both)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random Llama on the CPU, graphs emulated: the script only")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.tokens, args.pairs = 8, 1
    llm, names, seqs = mixed_engine(args.smoke, args.tokenizer, "loraserve-gpu-decode-")
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
                    sides[name]["host_split"] = host_split(llm, prompt, 64)
                    sides[name]["mixed_step"] = profile_mixed_step(llm, names, seqs, 8)
                    sides[name]["base_step"] = profile_mixed_step(llm, [None], seqs, 8)
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
