"""Adapter memory layouts and prefetch, driven by `loraserve bench` over HTTP.

The adapter memory layouts at equal adapter bytes (16 adapter-sized memories), bursty traffic
over 32 adapters (the default `--configs`):
T  = tiered: 8 compute slots + 8 host entries (max_loras_per_batch=8, max_loaded_loras=8)
U  = one memory of 16 packed host entries, the waiting queue prefetching disk -> host
U0 = the same memory without queue prefetch (only the next adapter is read)
Prefetch slots in tiered memory (equal slot memory, max_loaded_loras=12):
A = 4 slots + 4 prefetch slots, B = 8 slots LRU only, C = B + 4 prefetch slots.
Each (config, traffic) pair gets a fresh server; runs go in config order per traffic, and the
table compares every config with the first.

    .venv/bin/python benchmarks/prefetch.py [--traffic bursty] [--configs T,U,U0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, Server, scratch_dir, write_result  # noqa: E402

from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.bench.report import plot_cdfs  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

CONFIGS = {
    "T": ["--lora-memory", "tiered", "--max-loras-per-batch", "8", "--max-loaded-loras", "8"],
    "U": ["--lora-memory", "unified", "--max-loaded-loras", "16"],
    "U0": ["--lora-memory", "unified", "--max-loaded-loras", "16", "--disable-unified-prefetch"],
    "A": ["--lora-memory", "tiered", "--max-loaded-loras", "12", "--max-loras-per-batch", "4",
          "--max-loras-prefetch", "4"],
    "B": ["--lora-memory", "tiered", "--max-loaded-loras", "12", "--max-loras-per-batch", "8"],
    "C": ["--lora-memory", "tiered", "--max-loaded-loras", "12", "--max-loras-per-batch", "8",
          "--max-loras-prefetch", "4"],
}
TRAFFIC = {
    "uniform": ["--adapter-dist", "uniform"],
    "zipf1.5": ["--adapter-dist", "zipf", "--zipf-alpha", "1.5"],
    "bursty": ["--adapter-dist", "bursty", "--burst-size", "40"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=160)
    ap.add_argument("--request-rate", type=float, default=3.0)
    ap.add_argument("--input-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--traffic", default="bursty", help=f"of {','.join(TRAFFIC)}")
    ap.add_argument("--configs", default="T,U,U0", help=f"of {','.join(CONFIGS)}")
    args = ap.parse_args()
    work = scratch_dir("loraserve-prefetch-")
    model_dir = default_model_dir()
    paths = make_synthetic_adapters(model_dir, work / "adapters", args.num_adapters,
                                    ranks=(8, 16, 32, 64))
    lora_args = ["--lora-paths", *[f"{p.name}={p}" for p in paths]]
    configs = {c: CONFIGS[c] for c in args.configs.split(",")}
    tag = "prefetch-" + "-".join(configs)  # e.g. prefetch-T-U-U0
    results: dict[str, dict] = {}
    for traffic in args.traffic.split(","):
        for label, cfg in configs.items():
            name = f"{label}/{traffic}"
            out = work / f"{label}-{traffic}.json"
            server_args = ["--max-lora-rank", "64", *cfg, *lora_args]
            with Server(*server_args, log_path=work / f"{label}-{traffic}.log") as srv:
                cmd = [sys.executable, "-m", "loraserve.cli", "bench", "--base-url", srv.url,
                       "--adapter-prefix", "lora", "--num-adapters", str(args.num_adapters),
                       "--num-requests", str(args.num_requests), "--request-rate",
                       str(args.request_rate), "--input-len", str(args.input_len),
                       "--output-len", str(args.output_len), "--label", name,
                       "--result-json", str(out), "--disable-tqdm", "--quiet",
                       *TRAFFIC[traffic]]
                subprocess.run(cmd, check=True)
            results[name] = json.loads(out.read_text())
            s = results[name]["summary"]
            print(f"{name:22s} TTFT p50 {s['ttft_ms']['p50']:8.0f} ms  p99 "
                  f"{s['ttft_ms']['p99']:8.0f} ms  {s['output_throughput']:6.1f} tok/s  "
                  f"errors {s['errors']}", flush=True)
    table = {}
    for traffic in args.traffic.split(","):
        runs = {c: results[f"{c}/{traffic}"]["summary"] for c in configs}
        first = runs[next(iter(configs))]
        table[traffic] = {c: {
            "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
            "tok_s": r["output_throughput"], "errors": r["errors"],
            "p99_ttft_vs_first": r["ttft_ms"]["p99"] / first["ttft_ms"]["p99"] - 1,
            "throughput_vs_first": r["output_throughput"] / first["output_throughput"] - 1,
        } for c, r in runs.items()}
        bench_tag = os.environ.get("LORASERVE_BENCH_TAG")  # as write_result names the json
        plot_cdfs({k: v for k, v in results.items() if k.endswith("/" + traffic)},
                  RESULTS / f"{tag}-{traffic}{'-' + bench_tag if bench_tag else ''}.png")
    print(json.dumps(table, indent=2))
    print("wrote", write_result(tag, {"args": vars(args), "table": table}))


if __name__ == "__main__":
    main()
