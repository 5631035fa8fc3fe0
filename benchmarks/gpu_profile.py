"""Where a mixed-adapter batch loses against base-only on a GPU: the LoRA op against its
projection, per module group, and the engine's steps split into prefill and decode.

On the Llama-3.2-1B-shaped model of gpu_serving.py (bf16, 16 adapters of rank 8-64 on all
seven modules):
- op level: for T tokens spread evenly over the 16 adapters (T = 64: a decode step; 2048: a
  prefill step), each group's base projection and its LoRA op alone (shrink + expand, timed
  with CUDA events, median of 20), and the host's time to plan the step;
- step level: the gpu_serving workload, mixed and base-only, every engine step timed with the
  device synchronised: prefill and decode steps apart;
- the torch profiler's top kernels of one mixed run (`--trace`);
- `--k-chunks 1024,512,256`: the op level again for each part of d_in the Triton shrink's
  programs reduce over (lora/triton_sgmv.K_CHUNK), to choose it.

    PYTHONPATH=. python benchmarks/gpu_profile.py [--out DIR]     # on the GPU machine
    .venv/bin/python benchmarks/gpu_profile.py --smoke              # the script itself, on CPU
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
from gpu_serving import LLAMA_1B, SMOKE, sync  # noqa: E402

from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.lora.layout import GROUP_NAMES  # noqa: E402


def cuda_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    if not torch.cuda.is_available():  # --smoke on a CPU
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def op_level(llm: LLM, names: list[str], tokens: int) -> dict:
    eng = llm.engine
    backend, model = eng.runner.lora, eng.runner.model
    slot_of = {e.name: e.slot for e in eng.store.entries.values()}
    slots = [slot_of[n] for n in names]
    assert None not in slots, slot_of
    per = tokens // len(slots)
    seq_slots = [(s, per) for s in slots]
    t = time.perf_counter()
    for _ in range(10):
        plan = backend.plan(seq_slots)
    plan_ms = (time.perf_counter() - t) * 100
    w = model.layers[0]
    d = model.config.hidden_size
    x = {"qkv": d, "o": model.q_size, "gate_up": d, "down": model.inter}
    out = {"plan_host_ms": plan_ms}
    for g in GROUP_NAMES:
        lin = getattr(w, g)
        xin = torch.randn(per * len(slots), x[g], dtype=model.embed.dtype, device=eng.device)
        y = lin(xin)
        base = cuda_ms(lambda lin=lin, xin=xin: lin(xin))
        lora = cuda_ms(lambda g=g, xin=xin, y=y: backend.apply(plan, 0, g, xin, y))
        out[g] = {"base_ms": base, "lora_ms": lora, "lora_vs_base": lora / base}
    return out


def step_level(llm: LLM, prompts, loras, out_len: int) -> dict:
    runner = llm.engine.runner
    real = runner.execute
    steps: list[tuple[bool, int, float]] = []

    def timed(batch, slots):
        sync(runner.device.type)
        t = time.perf_counter()
        res = real(batch, slots)
        sync(runner.device.type)
        n = sum(k for _, k in batch.entries)
        steps.append((n == len(batch.entries), n, time.perf_counter() - t))
        return res

    runner.execute = timed
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True),
                 lora=loras)
    wall = time.perf_counter() - t
    runner.execute = real
    dec = [s for s in steps if s[0]]
    pre = [s for s in steps if not s[0]]
    return {"wall_s": wall, "execute_s": sum(s[2] for s in steps),
            "prefill_steps": len(pre), "prefill_s": sum(s[2] for s in pre),
            "prefill_tokens": sum(s[1] for s in pre),
            "decode_steps": len(dec), "decode_s": sum(s[2] for s in dec),
            "decode_ms_median": 1e3 * statistics.median([s[2] for s in dec]) if dec else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--tokenizer", default=None,
                    help="folder with the bundled model's tokenizer files (default: the model)")
    ap.add_argument("--num-adapters", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--trace", action="store_true", help="the torch profiler's top kernels")
    ap.add_argument("--k-chunks", default=None,
                    help="comma-separated shrink parts of d_in to time the ops with")
    ap.add_argument("--step-reps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random Llama on the CPU: checks the script, no figures")
    args = ap.parse_args()
    work = scratch_dir("loraserve-gpu-profile-")
    device, dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    if args.smoke:
        args.num_adapters, args.num_prompts, args.input_len, args.output_len = 4, 8, 8, 4
    model_dir = random_llama(SMOKE if args.smoke else LLAMA_1B, work / "model",
                             getattr(torch, dtype), args.tokenizer)
    paths = make_synthetic_adapters(model_dir, work, args.num_adapters, ranks=(8, 16, 32, 64))
    names = [p.name for p in paths]
    llm = LLM(model_dir, lora_paths={p.name: str(p) for p in paths}, device=device,
              dtype=dtype, max_loras_per_batch=args.num_adapters, max_lora_rank=64,
              enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 1, (args.num_prompts, args.input_len),
                            generator=g).tolist()
    loras = [names[i % len(names)] for i in range(args.num_prompts)]
    llm.generate(prompts[: len(names)], SamplingParams(max_tokens=4, ignore_eos=True),
                 lora=names)  # every adapter in a slot; kernels compiled
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "torch": torch.__version__}
    res["ops"] = {n: op_level(llm, names, n) for n in (64, 2048)}
    print(json.dumps(res["ops"], indent=1), flush=True)
    kernels = getattr(llm.engine.runner.lora, "kernels", None)  # lora/triton_sgmv.py
    if args.k_chunks and kernels is None:
        print("--k-chunks: the LoRA backend here is not triton's", flush=True)
    elif args.k_chunks:
        default = kernels.K_CHUNK
        res["ops_by_k_chunk"] = {}
        for chunk in (int(c) for c in args.k_chunks.split(",")):
            kernels.K_CHUNK = chunk
            res["ops_by_k_chunk"][chunk] = {n: op_level(llm, names, n) for n in (64, 2048)}
            print(f"K_CHUNK {chunk}:", json.dumps({n: {g: round(v["lora_ms"], 4) for g, v in
                                                         o.items() if g != "plan_host_ms"}
                                                   for n, o in
                                                   res["ops_by_k_chunk"][chunk].items()}),
                  flush=True)
        kernels.K_CHUNK = default
    for rep in range(args.step_reps):
        for mode, lo in (("multi", loras), ("base", None)):
            res[f"steps_{mode}_{rep}"] = step_level(llm, prompts, lo, args.output_len)
            print(mode, rep, json.dumps(res[f"steps_{mode}_{rep}"]), flush=True)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        for mode, lo in (("multi", loras), ("base", None)):
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with profile(activities=acts) as prof:
                llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), lora=lo)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
            print(f"--- {mode}: by device time\n{table}\n--- {mode}: by host time\n{cpu}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
