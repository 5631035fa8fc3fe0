"""Batch-1 decode on a GPU, replayed from CUDA graphs, with the element-wise steps as Triton
kernels (ops/triton_elementwise.py) against torch's ops: time per token, and what the torch
profiler sees in a step (kernels launched, their summed device time, the rest of the wall
time: the host's share between replays).

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
from gpu_serving import LLAMA_1B, SMOKE, copy_rate_gbs, sync  # noqa: E402

from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.engine.cuda_graphs import ReplayEmulator  # noqa: E402
from loraserve.ops.elementwise import set_gpu_enabled  # noqa: E402


def per_token_ms(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    sync(llm.engine.device.type)
    t = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    sync(llm.engine.device.type)
    assert len(out.token_ids) == tokens
    return 1e3 * (time.perf_counter() - t) / tokens


def profile_step(llm: LLM, prompt: list[int], tokens: int) -> dict:
    """Kernels per decode token and their device time, from the torch profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        llm.generate([prompt], params)
        sync(llm.engine.device.type)
        wall = time.perf_counter() - t
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"kernels_per_token": len(kernels) / tokens,
            "device_ms_per_token": busy / tokens, "wall_ms_per_token": 1e3 * wall / tokens,
            "top_kernels_ms_per_token": {k[:90]: v / tokens for k, v in top}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--json", default=None)
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
    llm = LLM(model_dir, device=device, dtype=str(dtype).removeprefix("torch."),
              enable_prefix_caching=False, cuda_graph_max_bs=8, **cpu)
    runner = llm.engine.runner
    prompt = list(range(100, 132))
    sides: dict[str, dict] = {"torch": {"ms": []}, "triton": {"ms": []}}
    for pair in range(args.pairs):
        for name in ("torch", "triton"):
            set_gpu_enabled(name == "triton")
            runner.enable_decode_graphs(8, llm.engine.max_model_len,
                                        None if device == "cuda" else ReplayEmulator)
            per_token_ms(llm, prompt, 8)  # warm-up: Triton compiles, the allocator settles
            sides[name]["ms"].append(per_token_ms(llm, prompt, args.tokens))
            if pair == 0:
                try:
                    sides[name]["profile"] = profile_step(llm, prompt, 32)
                except Exception as e:  # the timings above stand without it
                    sides[name]["profile"] = {"error": repr(e)}
            print(name, pair, f"{sides[name]['ms'][-1]:.3f} ms/token", flush=True)
    for s in sides.values():
        s["ms_per_token"] = statistics.median(s["ms"])
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "tokens": args.tokens, "sides": sides,
           "triton_vs_torch": sides["torch"]["ms_per_token"] / sides["triton"]["ms_per_token"]}
    if device == "cuda":
        res["copy_rate_gbs"] = copy_rate_gbs(device)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
