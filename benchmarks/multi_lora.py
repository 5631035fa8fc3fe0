"""Multi-LoRA throughput on the bundled model, side by side in one run.

64 requests (128 in, 64 out, greedy, ignore EOS) spread over 16 adapters of rank 8..64 on all
seven modules. Compares: loraserve with every adapter mixed in one batch; PEFT's mixed-batch
`generate(adapter_names=...)`; PEFT one adapter at a time (`set_adapter`, each adapter's
requests as one batch: the S-LoRA paper's baseline); loraserve base-only on the same prompts.

    .venv/bin/python benchmarks/multi_lora.py [--reps 1] [--pairs 4]

multi_vs_base is the median over back-to-back pairs of runs (each pair's base-only time over
its multi-adapter time), so the machine's drift between pairs cancels. Every model step of
those runs is timed, so the result also says where a multi-adapter run's extra time goes:
`extra_s` = multi - base, median of pairs, for the whole run, its prefill steps (steps with
more tokens than sequences) and its decode steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    StepTimes,
    median,
    random_prompts,
    scratch_dir,
    time_hf,
    time_ours,
    write_result,
)

from loraserve import LLM  # noqa: E402
from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402


def run_peft_sequential(peft_model, prompts, loras, out_len: int) -> float:
    t = time.perf_counter()
    for name in dict.fromkeys(loras):
        batch = [p for p, n in zip(prompts, loras, strict=True) if n == name]
        peft_model.set_adapter(name)
        time_hf(peft_model, batch, out_len)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1,
                    help="PEFT runs of each kind (0: multi vs base-only only)")
    ap.add_argument("--pairs", type=int, default=4, help="back-to-back multi/base runs of ours")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--no-full-warmup", action="store_true",
                    help="no untimed full-size run of each kind before the timed pairs")
    ap.add_argument("--ranks", default="8,16,32,64",
                    help="adapter ranks, cycled over the adapters (the small workload: 6 "
                         "adapters of ranks 4,8,16,32,48,64 over 32 requests)")
    ap.add_argument("--adapter-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of the adapter files (bf16: as adapters trained in bf16 are)")
    ap.add_argument("--lora-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="loraserve's lora_dtype: adapter weights in compute memory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ranks = tuple(int(r) for r in args.ranks.split(","))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = default_model_dir()
    tmp = scratch_dir("loraserve-bench-")
    paths = make_synthetic_adapters(model_dir, tmp, args.num_adapters, ranks=ranks,
                                    dtype=args.adapter_dtype)
    names = [p.name for p in paths]
    llm = LLM(model_dir, lora_paths={p.name: str(p) for p in paths},
              max_loras_per_batch=args.num_adapters, max_lora_rank=max(ranks),
              lora_dtype=args.lora_dtype,
              enable_prefix_caching=False)  # runs repeat the prompts; PEFT caches nothing
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, str(paths[0]), adapter_name=names[0])
    for p in paths[1:]:
        peft.load_adapter(str(p), adapter_name=p.name)
    peft.eval()
    cfg = llm.engine.model_config
    prompts = random_prompts(args.num_requests, args.input_len, cfg.vocab_size)
    loras = [names[i % len(names)] for i in range(args.num_requests)]
    n_out = args.num_requests * args.output_len

    # Warm-up with every adapter once, so timed runs start with all of them resident, as
    # PEFT's are (it holds every adapter in memory from the start).
    time_ours(llm, prompts[: len(names)], 4, names)
    # Then one untimed full-size run of each kind: the first pays first-touch costs (KV blocks,
    # step buffers) that later runs do not, and would otherwise fall in pair 0 and pull its
    # ratio down. PEFT gets a short warm-up of its own.
    if not args.no_full_warmup:
        time_ours(llm, prompts, args.output_len, loras)
        time_ours(llm, prompts, args.output_len, None)
        if args.reps:
            time_hf(peft, prompts[:4], 4, adapter_names=loras[:4])
    runs: dict[str, list[float]] = {"ours_multi": [], "ours_base": [], "peft_mixed": [],
                                    "peft_sequential": []}
    # Ours, multi and base-only back to back in alternating order (the host's speed drifts
    # from minute to minute, so each pair's ratio is the robust figure); then PEFT's runs.
    pair_ratios = []
    steps = StepTimes()
    split: dict[str, list[tuple[float, float]]] = {"ours_multi": [], "ours_base": []}
    for i in range(args.pairs):
        order = ("ours_multi", "ours_base") if i % 2 == 0 else ("ours_base", "ours_multi")
        for k in order:
            steps.clear()
            runs[k].append(time_ours(llm, prompts, args.output_len,
                                     loras if k == "ours_multi" else None))
            split[k].append(steps.split())
        pair_ratios.append(runs["ours_base"][-1] / runs["ours_multi"][-1])
        print(f"pair {i}: multi {runs['ours_multi'][-1]:.1f}s  base {runs['ours_base'][-1]:.1f}s"
              f"  multi/base throughput {pair_ratios[-1]:.3f}", flush=True)
    for i in range(args.reps):
        runs["peft_mixed"].append(time_hf(peft, prompts, args.output_len, adapter_names=loras))
        runs["peft_sequential"].append(run_peft_sequential(peft, prompts, loras,
                                                           args.output_len))
        print(f"peft rep {i}: mixed {runs['peft_mixed'][-1]:.1f}s  "
              f"sequential {runs['peft_sequential'][-1]:.1f}s", flush=True)
    tok_s = {k: n_out / median(v) for k, v in runs.items() if v}
    res = {
        "workload": vars(args),
        "tok_s": tok_s,
        "multi_vs_base": median(pair_ratios),
        "multi_vs_base_per_pair": pair_ratios,
        "multi_vs_base_of_medians": tok_s["ours_multi"] / tok_s["ours_base"],
        "extra_s": {
            "run": median([m - b for m, b in zip(runs["ours_multi"], runs["ours_base"],
                                                 strict=True)]),
            **{part: median([m[j] - b[j] for m, b in zip(split["ours_multi"],
                                                         split["ours_base"], strict=True)])
               for j, part in enumerate(("prefill", "decode"))}},
    }
    for k, v in tok_s.items():
        print(f"{k:18s} {v:8.1f} output tok/s")
    if args.reps:
        res["ratio_vs_peft_mixed"] = tok_s["ours_multi"] / tok_s["peft_mixed"]
        res["ratio_vs_peft_sequential"] = tok_s["ours_multi"] / tok_s["peft_sequential"]
    for k in ("ratio_vs_peft_mixed", "ratio_vs_peft_sequential", "multi_vs_base",
              "multi_vs_base_of_medians"):
        if k in res:
            print(f"{k:26s} {res[k]:.3f}")
    print("multi - base, median of pairs: " + "  ".join(
        f"{part} {v:+.3f} s" for part, v in res["extra_s"].items()))
    name = "multi_lora" if args.reps else "multi_lora-vs-base"
    if (args.num_requests, args.num_adapters, ranks) != (64, 16, (8, 16, 32, 64)):
        name += f"-{args.num_requests}req-{args.num_adapters}ad-r{'_'.join(map(str, ranks))}"
    if (args.adapter_dtype, args.lora_dtype) != ("float32", "auto"):
        name += f"-adapters_{args.adapter_dtype}-lora_dtype_{args.lora_dtype}"
    print("wrote", write_result(name, res))


if __name__ == "__main__":
    main()
