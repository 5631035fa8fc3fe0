"""bf16 against float32 weights on CPU (`--dtype bfloat16` / `float32`), on the bundled model.

Two engines in one process, the same prompts, rounds alternating which goes first: prefill
rate (prompts x input tokens, one output token each, prefix cache off), batched decode rate
(decode steps only, all sequences past their prompts), batch-1 decode rate and decode with
adapters in the batch (a different adapter per sequence; with bf16 weights the LoRA op runs
after the projection instead of fused into it). Also greedy agreement of bf16 with float32 on
chat prompts: tokens equal up to the first difference, and outputs equal in full. Where the
CPU has no fast bf16 matmul, bf16 is refused at load: the run reports the refusal and what
torch's own bf16 matmul would cost there.

    .venv/bin/python benchmarks/cpu_dtypes.py [--reps 3] [--threads 2]
    .venv/bin/python tools/both_isas.py cpu_dtypes          # native and imitated AVX2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import median, median_time, random_prompts, scratch_dir, write_result  # noqa: E402
from offline_throughput import decode_rate  # noqa: E402

from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402
from loraserve.ops import bf16_gemm  # noqa: E402

CHAT = ["Explain why the sky is blue.", "Write a haiku about autumn rain.",
        "What is the capital of Australia, and why is it not Sydney?",
        "List three uses of a paperclip.", "How does a bicycle stay upright?",
        "Summarize the plot of Romeo and Juliet in two sentences.",
        "Give me a recipe for pancakes.", "What is 17 times 23? Show your steps.",
        "Describe the water cycle.", "Why do cats purr?",
        "Translate 'good morning, friend' into French and Spanish.",
        "What are prime numbers?"]


def prefill_rate(llm: LLM, prompts) -> float:
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return sum(len(p) for p in prompts) / (time.perf_counter() - t)


def lora_decode_rate(llm: LLM, prompts, names, steps: int) -> float:
    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(p, params, lora_name=n) for p, n in zip(prompts, names, strict=True)]
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in reqs):
        eng.step()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = time.perf_counter() - t
    for r in reqs:
        eng.abort(r.request_id)
    return len(prompts) * steps / dt


def agreement(a: LLM, b: LLM, n_tokens: int) -> dict:
    """Greedy outputs of the chat prompts under both: the mean share of each output equal
    before the first difference, and how many are equal in full."""
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    outs = [[o.token_ids for o in llm.generate([[{"role": "user", "content": c}] for c in CHAT],
                                               params)] for llm in (a, b)]
    prefix = []
    for x, y in zip(*outs, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        prefix.append(same / len(x))
    return {"prompts": len(CHAT), "tokens": n_tokens,
            "mean_prefix_share": sum(prefix) / len(prefix),
            "equal_in_full": sum(p == 1.0 for p in prefix)}


def torch_bf16_cost() -> float:
    """torch's plain bf16 matmul rate / its float32 rate (what bf16 costs where oneDNN has
    none: the refused case)."""
    w, x = torch.randn(2048, 1024), torch.randn(64, 1024)
    wb, xb = w.bfloat16(), x.bfloat16()
    f32 = median_time(lambda: torch.nn.functional.linear(x, w), 5)
    b16 = median_time(lambda: torch.nn.functional.linear(xb, wb), 5)
    return f32 / b16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--agree-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    adapters = make_synthetic_adapters(model_dir, scratch_dir("cpu_dtypes_"),
                                       args.num_adapters, ranks=[16])
    kw = dict(enable_prefix_caching=False, kv_cache_tokens=16384,
              lora_paths={p.name: str(p) for p in adapters})
    engines = {"float32": LLM(model_dir, dtype="float32", **kw)}
    res: dict = {"workload": vars(args), "bf16_probe_speed": bf16_gemm.bf16_speed()}
    try:
        engines["bfloat16"] = LLM(model_dir, dtype="bfloat16", **kw)
    except ValueError as e:
        res.update(bf16_refused=str(e), torch_bf16_matmul_vs_fp32=torch_bf16_cost())
        print(res)
        print("wrote", write_result("cpu_dtypes", res))
        return
    vocab = engines["float32"].engine.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    names = [adapters[i % len(adapters)].name for i in range(args.decode_batch)]
    rates: dict[str, dict[str, list[float]]] = {d: {} for d in engines}
    for llm in engines.values():  # warm-up: kernels built, adapters read
        prefill_rate(llm, prompts[:2])
        lora_decode_rate(llm, prompts[:len(adapters)], names[:len(adapters)], 2)
    for rep in range(args.reps):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for dtype in order:
            llm, r = engines[dtype], rates[dtype]
            r.setdefault("prefill_tok_s", []).append(prefill_rate(llm, prompts))
            r.setdefault("decode_batch_tok_s", []).append(
                decode_rate(llm, prompts[:args.decode_batch], 16))
            r.setdefault("decode_batch_lora_tok_s", []).append(
                lora_decode_rate(llm, prompts[:args.decode_batch], names, 16))
            r.setdefault("decode_1_tok_s", []).append(decode_rate(llm, prompts[:1], 32))
        print(f"rep {rep}: " + "  ".join(f"{d} {k} {v[-1]:.0f}" for d in engines
                                         for k, v in rates[d].items()), flush=True)
    for dtype, r in rates.items():
        res[dtype] = {k: median(v) for k, v in r.items()}
        res[dtype + "_spread"] = {k: [min(v), max(v)] for k, v in r.items()}
    # each round runs both back to back: the median of their ratios cancels the host's drift
    res["bf16_over_fp32"] = {k: median([b / f for b, f in zip(rates["bfloat16"][k], v,
                                                               strict=True)])
                             for k, v in rates["float32"].items()}
    res["greedy_agreement"] = agreement(engines["float32"], engines["bfloat16"],
                                        args.agree_tokens)
    for k, v in res.items():
        print(f"{k:28s} {v}")
    print("wrote", write_result("cpu_dtypes", res))


if __name__ == "__main__":
    main()
