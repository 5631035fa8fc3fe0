"""Adapter churn on a GPU: more adapters than compute slots, so requests wait for their
adapter's host -> device copy (and disk reads beyond the host cache). Time to first token
under bursty traffic, in-process (no HTTP), per configuration:
- B  8 slots, slot copies on a side stream (the default);
- B-blocking  the same, each slot copy waited for on the host as it is issued;
- A  4 slots + 4 prefetch slots (equal slot memory), the waiting queue filling them ahead;
- C  8 slots + 4 prefetch slots.
Each configuration gets a fresh engine on the same model, adapters and requests.

    PYTHONPATH=. python benchmarks/gpu_churn.py [--json FILE]      # on the GPU machine
    .venv/bin/python benchmarks/gpu_churn.py --smoke                # the script itself, on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    add_kernel_shapes_argument,
    random_llama,
    scratch_dir,
    set_kernel_shapes,
)
from gpu_serving import LLAMA_1B, SMOKE, sync  # noqa: E402

from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.adapters.slot_copies import StreamSlotCopies  # noqa: E402
from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.bench.workload import WorkloadConfig, generate_workload  # noqa: E402

CONFIGS = {  # name -> (engine knobs, blocking copies)
    "B": ({"max_loras_per_batch": 8}, False),
    "B-blocking": ({"max_loras_per_batch": 8}, True),
    "A": ({"max_loras_per_batch": 4, "max_loras_prefetch": 4}, False),
    "C": ({"max_loras_per_batch": 8, "max_loras_prefetch": 4}, False),
}


def blocking_copies() -> None:
    """Slot copies waited for on the host as they are issued (the baseline a side stream
    beats): the step that needs the slot cannot overlap anything with the copy."""
    real = StreamSlotCopies.write

    def write(self, slot, pairs):
        real(self, slot, pairs)
        self.stream.synchronize()

    StreamSlotCopies.write = write


def run(llm: LLM, reqs, device: str) -> dict:
    eng = llm.engine
    arrived, first = {}, {}
    pending = sorted(reqs, key=lambda r: r.arrival)
    i = 0
    sync(device)
    t0 = time.perf_counter()
    while i < len(pending) or eng.has_work:
        now = time.perf_counter() - t0
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            eng.add_request(r.prompt, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                     ignore_eos=True), r.adapter, f"r{r.index}")
            arrived[f"r{r.index}"] = now
            i += 1
        if not eng.has_work:
            time.sleep(min(0.002, max(0.0, pending[i].arrival - now)))
            continue
        for out in eng.step():
            if out.request_id not in first and out.token_ids:
                first[out.request_id] = time.perf_counter() - t0
    ttft = sorted(1e3 * (first[k] - arrived[k]) for k in arrived)
    return {"ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "wall_s": time.perf_counter() - t0,
            "disk_loads": sum(e.stats.loads for e in eng.store.entries.values()),
            "slot_evictions": sum(e.stats.slot_evictions for e in eng.store.entries.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=240)
    ap.add_argument("--request-rate", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    add_kernel_shapes_argument(ap)
    args = ap.parse_args()
    set_kernel_shapes(args.kernel_shapes)
    device, dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    if args.smoke:
        args.num_adapters, args.num_requests, args.request_rate = 6, 16, 50.0
    work = scratch_dir("loraserve-gpu-churn-")
    model_dir = random_llama(SMOKE if args.smoke else LLAMA_1B, work / "model",
                             getattr(torch, dtype), args.tokenizer)
    paths = make_synthetic_adapters(model_dir, work, args.num_adapters, ranks=(8, 16, 32))
    names = [p.name for p in paths]
    reqs = generate_workload(WorkloadConfig(
        num_requests=args.num_requests, request_rate=args.request_rate, adapters=tuple(names),
        adapter_dist="bursty", burst_size=8, input_len=128, output_len=32, seed=0,
        token_id_range=(100, 500) if args.smoke else (100, 10000)))
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "args": vars(args), "configs": {}}
    def engine(**knobs) -> LLM:  # graphs up to 32 sequences: each engine records its own
        return LLM(model_dir, lora_paths={p.name: str(p) for p in paths}, device=device,
                   dtype=dtype, lora_memory="tiered", max_loaded_loras=16, max_lora_rank=32,
                   enable_prefix_caching=False, cuda_graph_max_bs=32, kv_cache_tokens=65536,
                   **knobs)

    warm = engine(max_loras_per_batch=8)  # kernels compiled before the first measured run
    run(warm, reqs[:16], device)
    warm.engine.shutdown()
    del warm
    configs = args.configs.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.reps):  # configurations interleaved: a cut run keeps each one's reps
        for name in configs:
            knobs, blocking = CONFIGS[name]
            real_write = StreamSlotCopies.write
            if blocking:
                blocking_copies()
            try:
                llm = engine(**knobs)
                runs[name].append(run(llm, reqs, device))
                llm.engine.shutdown()
                del llm
                if device == "cuda":
                    torch.cuda.empty_cache()
            finally:
                StreamSlotCopies.write = real_write
            reps = runs[name]
            res["configs"][name] = {"reps": reps, **{
                k: statistics.median(r[k] for r in reps) for k in reps[0]}}
            print(name, json.dumps(reps[-1]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
