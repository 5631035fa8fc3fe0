"""Prefetch vs LRU-only at equal slot memory, driven by `loraserve bench` over HTTP.

A: max_loras_per_batch=4, max_loras_prefetch=4 (8 slots, prefetch on)
B: max_loras_per_batch=8                       (8 slots, LRU only)
Both with max_loaded_loras below the adapter count, so host misses go to disk. Traffic:
uniform, zipf 1.5 and bursty over 32 adapters. Each (config, traffic) pair gets a fresh
server; runs alternate A, B so that machine noise hits both.

    .venv/bin/python benchmarks/prefetch.py [--num-requests 160] [--request-rate 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, Server, write_result  # noqa: E402

from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.bench.report import plot_cdfs  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

CONFIGS = {
    "A-prefetch": ["--max-loras-per-batch", "4", "--max-loras-prefetch", "4"],
    "B-lru": ["--max-loras-per-batch", "8"],
    # Not equal memory (12 slots): prefetch on top of B, to see what prefetch adds by itself.
    "C-lru+prefetch": ["--max-loras-per-batch", "8", "--max-loras-prefetch", "4"],
}
TRAFFIC = {
    "uniform": ["--adapter-dist", "uniform"],
    "zipf1.5": ["--adapter-dist", "zipf", "--zipf-alpha", "1.5"],
    "bursty": ["--adapter-dist", "bursty", "--burst-size", "40"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--max-loaded-loras", type=int, default=12)
    ap.add_argument("--num-requests", type=int, default=160)
    ap.add_argument("--request-rate", type=float, default=3.0)
    ap.add_argument("--input-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--traffic", default=",".join(TRAFFIC))
    ap.add_argument("--configs", default="A-prefetch,B-lru", help=f"of {','.join(CONFIGS)}")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="loraserve-prefetch-"))
    model_dir = default_model_dir()
    paths = make_synthetic_adapters(model_dir, work / "adapters", args.num_adapters,
                                    ranks=(8, 16, 32, 64))
    lora_args = ["--lora-paths", *[f"{p.name}={p}" for p in paths]]
    configs = {c: CONFIGS[c] for c in args.configs.split(",")}
    tag = "prefetch" if list(configs) == ["A-prefetch", "B-lru"] else "prefetch-" + "-vs-".join(
        c.split("-")[0] for c in configs)  # e.g. prefetch-C-vs-B
    results: dict[str, dict] = {}
    for traffic in args.traffic.split(","):
        for label, cfg in configs.items():
            name = f"{label}/{traffic}"
            out = work / f"{label}-{traffic}.json"
            server_args = ["--max-loaded-loras", str(args.max_loaded_loras), "--max-lora-rank",
                           "64", *cfg, *lora_args]
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
        a, b = (results[f"{c}/{traffic}"]["summary"] for c in list(configs)[:2])
        table[traffic] = {
            "A_ttft_p50_ms": a["ttft_ms"]["p50"], "A_ttft_p99_ms": a["ttft_ms"]["p99"],
            "B_ttft_p50_ms": b["ttft_ms"]["p50"], "B_ttft_p99_ms": b["ttft_ms"]["p99"],
            "A_tok_s": a["output_throughput"], "B_tok_s": b["output_throughput"],
            "p99_ttft_change": a["ttft_ms"]["p99"] / b["ttft_ms"]["p99"] - 1,
            "throughput_change": a["output_throughput"] / b["output_throughput"] - 1,
        }
        plot_cdfs({k: v for k, v in results.items() if k.endswith("/" + traffic)},
                  RESULTS / f"{tag}-{traffic}.png")
    print(json.dumps(table, indent=2))
    print("wrote", write_result(tag, {"args": vars(args), "table": table}))


if __name__ == "__main__":
    main()
