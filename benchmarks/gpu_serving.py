"""Multi-LoRA serving on one GPU: loraserve against transformers + PEFT, same GPU,
same weights, one process.

Models (no download): the bundled SmolLM2-135M, and a randomly initialised Llama with
Llama-3.2-1B's shapes (`--models`). Per model: 16 synthetic adapters of rank 8..64 on all seven
modules; N prompts (random token ids) mixed over every adapter in every batch, greedy, ignore
EOS. Reported, each the median of `--reps` runs:
- loraserve mixed adapters / PEFT mixed-batch `generate(adapter_names=...)` / PEFT one adapter
  at a time (`set_adapter`) / loraserve base-only on the same prompts;
- multi-adapter throughput as a fraction of base-only;
- batch-1 decode tokens/s against the bandwidth floor (weight bytes / the device's copy rate
  measured in the same run), with the decode steps replayed from CUDA graphs (the default) and
  run eagerly (the same engine, its graphs set aside).

    PYTHONPATH=. python benchmarks/gpu_serving.py                 # on the GPU machine
    .venv/bin/python benchmarks/gpu_serving.py --device cpu --smoke  # the script itself, on CPU
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
from common import (  # noqa: E402
    add_kernel_shapes_argument,
    random_llama,
    scratch_dir,
    set_kernel_shapes,
    write_result,
)

from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

LLAMA_1B = {  # Llama-3.2-1B's shapes; weights random (nothing is downloaded)
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 4096, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
         "max_position_embeddings": 512, "tie_word_embeddings": False}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_rate_gbs(device: str, mb: int = 1024) -> float:
    """Device memory bandwidth measured now: read + write of a large copy."""
    x = torch.empty(mb * 2**20 // 2, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * x.numel() * 2 / statistics.median(times) / 1e9


def time_loraserve(llm: LLM, prompts, out_len: int, loras=None) -> float:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    sync(llm.engine.device.type)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    sync(llm.engine.device.type)
    assert all(len(o.token_ids) == out_len for o in outs)
    return time.perf_counter() - t


def time_peft(model, prompts, out_len: int, device: str, **kw) -> float:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                       min_new_tokens=out_len, do_sample=False, pad_token_id=0, **kw)
    sync(device)
    return time.perf_counter() - t


def bench_model(label: str, model_dir: Path, args, dtype: torch.dtype) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp = scratch_dir(f"loraserve-gpu-{label}-")
    ranks = (8, 16, 32, 64) if not args.smoke else (4, 8)
    paths = make_synthetic_adapters(model_dir, tmp, args.num_adapters, ranks=ranks)
    names = [p.name for p in paths]
    llm = LLM(model_dir, lora_paths={p.name: str(p) for p in paths}, device=args.device,
              dtype=args.dtype, max_loras_per_batch=args.num_adapters, max_lora_rank=max(ranks),
              enable_prefix_caching=False,  # runs repeat the prompts; PEFT caches nothing
              max_num_seqs=max(256, *args.concurrency))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    with_peft = args.peft_reps > 0 or args.peft_sequential_reps > 0
    if with_peft:
        peft = PeftModel.from_pretrained(hf, str(paths[0]), adapter_name=names[0])
        for p in paths[1:]:
            peft.load_adapter(str(p), adapter_name=p.name)
        peft.eval()
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 1, (args.num_prompts, args.input_len),
                            generator=g).tolist()
    loras = [names[i % len(names)] for i in range(args.num_prompts)]
    time_loraserve(llm, prompts[: len(names)], 4, names)  # warm-up: every adapter resident
    if with_peft:
        time_peft(peft, prompts[:2], 2, args.device, adapter_names=loras[:2])
    runs: dict[str, list[float]] = {k: [] for k in ("ours_multi", "ours_base", "peft_mixed",
                                                     "peft_sequential")}
    for rep in range(args.reps):
        runs["ours_multi"].append(time_loraserve(llm, prompts, args.output_len, loras))
        runs["ours_base"].append(time_loraserve(llm, prompts, args.output_len))
        if rep < args.peft_reps:
            runs["peft_mixed"].append(time_peft(peft, prompts, args.output_len, args.device,
                                                adapter_names=loras))
        if rep < args.peft_sequential_reps:
            t = time.perf_counter()
            for name in names:
                batch = [p for p, n in zip(prompts, loras, strict=True) if n == name]
                peft.set_adapter(name)
                time_peft(peft, batch, args.output_len, args.device)
            runs["peft_sequential"].append(time.perf_counter() - t)
        print(f"{label} rep {rep}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in runs.items()
                                                 if v), flush=True)
    n_out = args.num_prompts * args.output_len
    tok_s = {k: n_out / statistics.median(v) for k, v in runs.items() if v}
    b1 = [args.output_len / time_loraserve(llm, prompts[:1], args.output_len)
          for _ in range(3)]
    graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None  # the same, eagerly
    b1_eager = [args.output_len / time_loraserve(llm, prompts[:1], args.output_len)
                for _ in range(3)]
    llm.engine.runner.graphs = graphs
    bw = copy_rate_gbs(args.device)
    floor = bw * 1e9 / weight_bytes
    # many sequences decoding at once (base model, 16-token prompts: decode dominates): a step
    # reads the weights once for all of them, so the floor is batch x the batch-1 floor
    concurrent = {}
    for batch in args.concurrency:
        short = [p[:16] for p in (prompts * (batch // len(prompts) + 1))[:batch]]
        rates = [batch * args.output_len / time_loraserve(llm, short, args.output_len)
                 for _ in range(args.reps)]
        concurrent[batch] = {"tok_s": statistics.median(rates), "tok_s_reps": rates,
                             "floor_tok_s": batch * floor,
                             "of_floor": statistics.median(rates) / (batch * floor)}
    return {"tok_s": tok_s, "runs_s": runs, "concurrent_base": concurrent,
            "ratio_vs_peft_mixed": (tok_s["ours_multi"] / tok_s["peft_mixed"]
                                    if "peft_mixed" in tok_s else None),
            "ratio_vs_peft_sequential": (tok_s["ours_multi"] / tok_s["peft_sequential"]
                                         if "peft_sequential" in tok_s else None),
            "multi_vs_base": tok_s["ours_multi"] / tok_s["ours_base"],
            "batch1_decode_tok_s": statistics.median(b1), "batch1_reps": b1,
            "batch1_decode_tok_s_without_cuda_graphs": statistics.median(b1_eager),
            "batch1_eager_reps": b1_eager,
            "batch1_time_vs_floor_without_cuda_graphs": floor / statistics.median(b1_eager),
            "cuda_graphs": None if graphs is None else len(graphs.graphs),
            "copy_rate_gbs": bw,
            "batch1_floor_tok_s": floor,
            "batch1_time_vs_floor": floor / statistics.median(b1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--models", default="smollm2,llama-1b")
    ap.add_argument("--num-adapters", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peft-reps", type=int, default=3,
                    help="reps of PEFT's mixed batch (at most --reps; 0: none)")
    ap.add_argument("--peft-sequential-reps", type=int, default=3,
                    help="reps of PEFT one adapter at a time (the slowest; at most --reps)")
    ap.add_argument("--concurrency", type=lambda s: [int(b) for b in s.split(",")],
                    default=[64, 256], help="base-only decode batches against their floor")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random Llama and small numbers: checks the script, no figures")
    ap.add_argument("--tokenizer", default=None,
                    help="folder with the bundled model's tokenizer files (default: the model)")
    add_kernel_shapes_argument(ap)
    args = ap.parse_args()
    set_kernel_shapes(args.kernel_shapes)
    if args.smoke:
        args.models, args.num_adapters, args.num_prompts = "smoke", 4, 4
        args.input_len, args.output_len, args.reps = 8, 4, 1
        args.concurrency = [8]
        if args.device == "cpu":
            args.dtype = "float32"  # loraserve computes in float32 on CPU
    dtype = getattr(torch, args.dtype)
    work = scratch_dir("loraserve-gpu-models-")
    models = {"smollm2": lambda: default_model_dir(),
              "llama-1b": lambda: random_llama(LLAMA_1B, work / "llama-1b", dtype,
                                               args.tokenizer),
              "smoke": lambda: random_llama(SMOKE, work / "smoke", dtype, args.tokenizer)}
    device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else "cpu")
    results = {"device": device_name, "args": vars(args)}
    for label in args.models.split(","):
        results[label] = bench_model(label, models[label](), args, dtype)
        print(label, json.dumps(results[label], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.smoke:
        print("wrote", write_result("gpu_serving", results))


if __name__ == "__main__":
    main()
