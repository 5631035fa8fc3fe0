"""Prefix cache on against off, through the server.

200 requests share a 512-token system prompt, each with its own 32-token question and 32
output tokens (greedy, ignore_eos), over 8 adapters (round robin), all sent at t=0 to a fresh
`loraserve serve` on the bundled SmolLM2-135M. Each round runs cache on, then cache off, in
this one process: throughput, TTFT p50/p99 as the client sees them, and the prompt tokens the
server actually computed (/metrics: queries - hits, per adapter).

Targets: computed prompt tokens <= 1.05 x (unique tokens + one system prompt per adapter);
output throughput >= 3x the cache-off run.

    .venv/bin/python benchmarks/prefix_cache.py [--num-requests 200] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, Server, scratch_dir, write_result  # noqa: E402

from loraserve.bench.client import run_requests  # noqa: E402
from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.bench.report import plot_cdfs, summarize  # noqa: E402
from loraserve.bench.workload import BenchRequest  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

CONFIGS = {"cache-on": [], "cache-off": ["--disable-prefix-cache"]}


def build_requests(n: int, system_len: int, question_len: int, out_len: int,
                   adapters: list[str]) -> list[BenchRequest]:
    # Token ids above the special range; the system prompt is the same for every request.
    system = [100 + (37 * i) % 40000 for i in range(system_len)]
    reqs = []
    for i in range(n):
        question = [100 + (7919 * (i * question_len + j) + 13) % 40000
                    for j in range(question_len)]
        reqs.append(BenchRequest(index=i, arrival=0.0, model=adapters[i % len(adapters)],
                                 adapter=adapters[i % len(adapters)], prompt=system + question,
                                 input_len=system_len + question_len, output_len=out_len))
    return reqs


def computed_prompt_tokens(url: str) -> tuple[float, float]:
    """(queries, hits) summed over every adapter and the base model, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.M))

    return total("loraserve_prefix_cache_queries"), total("loraserve_prefix_cache_hits")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--server-args", default="", help="extra `loraserve serve` flags")
    args = ap.parse_args()
    work = scratch_dir("loraserve-prefix-")
    paths = make_synthetic_adapters(default_model_dir(), work / "adapters", args.num_adapters,
                                    ranks=(16,))
    names = [p.name for p in paths]
    lora_args = ["--lora-paths", *[f"{p.name}={p}" for p in paths]]
    reqs = build_requests(args.num_requests, args.system_len, args.question_len,
                          args.output_len, names)
    floor = args.num_requests * args.question_len + args.num_adapters * args.system_len
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    last_results = {}
    for rnd in range(args.rounds):
        for label, flags in CONFIGS.items():
            with Server(*lora_args, *flags, *args.server_args.split(),
                        log_path=work / f"{label}-{rnd}.log") as srv:
                results, wall = asyncio.run(run_requests(reqs, srv.url))
                queries, hits = computed_prompt_tokens(srv.url)
            s = summarize(results, wall)
            run = {"wall_s": wall, "output_tok_s": s["output_throughput"],
                   "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                   "errors": s["errors"], "prompt_tokens": queries,
                   "computed_prompt_tokens": queries - hits}
            runs[label].append(run)
            last_results[label] = results
            print(f"round {rnd} {label:9s} {wall:7.1f} s  {run['output_tok_s']:7.1f} tok/s  "
                  f"TTFT p50 {run['ttft_p50_ms']:8.0f} ms p99 {run['ttft_p99_ms']:8.0f} ms  "
                  f"computed prompt tokens {run['computed_prompt_tokens']:.0f} / {queries:.0f}  "
                  f"errors {run['errors']}", flush=True)

    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[label])

    table = {
        "throughput_ratio_on_over_off": med("cache-on", "output_tok_s")
        / med("cache-off", "output_tok_s"),
        "ttft_p50_ms": {c: med(c, "ttft_p50_ms") for c in CONFIGS},
        "ttft_p99_ms": {c: med(c, "ttft_p99_ms") for c in CONFIGS},
        "computed_prompt_tokens": {c: med(c, "computed_prompt_tokens") for c in CONFIGS},
        "unique_plus_one_system_per_adapter": floor,
        "computed_over_floor": med("cache-on", "computed_prompt_tokens") / floor,
    }
    plot_cdfs(last_results, RESULTS / "prefix_cache.png")
    print(table)
    print("wrote", write_result("prefix_cache", {"args": vars(args), "runs": runs,
                                                 "table": table}))


if __name__ == "__main__":
    main()
