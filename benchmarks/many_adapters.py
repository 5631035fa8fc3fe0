"""1,000 registered adapters against 16, the same traffic, over HTTP.

One server on the bundled model with host memory for 64 adapters (`--max-loaded-loras 64`).
Adapters (ranks 8 and 16, bf16, on q_proj and v_proj by default) are registered at run time
through `POST /v1/load_lora_adapter`: the registration time per adapter and the time of
`GET /v1/models` with all of them listed are measured. Then `loraserve bench` sends the same
zipf-popular traffic over 16 of them and over all 1,000, alternating, `--rounds` times each;
with `--cold`, every adapter file is dropped from the page cache (posix_fadvise) before each
1,000-adapter round, so reloads after host evictions read the disk. Reported: output
throughput of 1,000 against 16 (median of the rounds), p50/p99 TTFT of each.

    .venv/bin/python benchmarks/many_adapters.py [--num-adapters 1000] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import Server, scratch_dir, write_result  # noqa: E402

from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402


def register(url: str, paths: list[Path]) -> float:
    """Seconds per adapter to register each through the API (one request at a time)."""
    t0 = time.perf_counter()
    with httpx.Client(timeout=120) as client:
        for p in paths:
            client.post(url + "/v1/load_lora_adapter",
                        json={"lora_name": p.name, "lora_path": str(p)}).raise_for_status()
    return (time.perf_counter() - t0) / len(paths)


def models_latency(url: str, reps: int = 20) -> tuple[float, int]:
    """Median seconds of GET /v1/models, and how many models it listed."""
    times, n = [], 0
    with httpx.Client(timeout=60) as client:
        for _ in range(reps):
            t0 = time.perf_counter()
            r = client.get(url + "/v1/models")
            times.append(time.perf_counter() - t0)
            n = len(r.json()["data"])
    return statistics.median(times), n


def drop_page_cache(paths: list[Path]) -> None:
    for d in paths:
        for f in d.iterdir():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench(url: str, n: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "loraserve.cli", "bench", "--base-url", url,
           "--adapter-prefix", "lora", "--num-adapters", str(n), "--adapter-dist", "zipf",
           "--zipf-alpha", str(args.zipf_alpha), "--num-requests", str(args.num_requests),
           "--request-rate", str(args.request_rate), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--seed", "0", "--label", f"{n} adapters",
           "--result-json", str(out), "--disable-tqdm", "--quiet"]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-adapters", type=int, default=1000)
    ap.add_argument("--few", type=int, default=16, help="the comparison's adapter count")
    ap.add_argument("--max-loaded-loras", type=int, default=64)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--num-requests", type=int, default=160)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--zipf-alpha", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop adapter files from the page "
                    "cache before each round over all adapters")
    args = ap.parse_args()
    work = scratch_dir("loraserve-many-adapters-")
    t0 = time.perf_counter()
    paths = make_synthetic_adapters(default_model_dir(), work / "adapters", args.num_adapters,
                                    ranks=(8, 16), target_modules=args.targets.split(","),
                                    dtype="bfloat16")
    print(f"wrote {len(paths)} adapters in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = {args.few: [], args.num_adapters: []}
    with Server("--max-loaded-loras", str(args.max_loaded_loras), "--max-lora-rank", "16",
                "--allow-runtime-lora-updates", log_path=work / "server.log") as srv:
        per_adapter = register(srv.url, paths)
        models_s, listed = models_latency(srv.url)
        print(f"registration {per_adapter * 1e3:.1f} ms/adapter; /v1/models {models_s * 1e3:.1f}"
              f" ms for {listed} models", flush=True)
        for r in range(args.rounds):
            for n in (args.few, args.num_adapters):
                if n == args.num_adapters and args.cold:
                    drop_page_cache(paths)
                s = bench(srv.url, n, args, work / f"{n}-{r}.json")
                rows[n].append(s)
                print(f"round {r} {n:5d} adapters: {s['output_throughput']:6.1f} tok/s  TTFT p50"
                      f" {s['ttft_ms']['p50']:7.0f} ms  p99 {s['ttft_ms']['p99']:7.0f} ms  "
                      f"errors {s['errors']}", flush=True)

    def med(n, key, sub=None):
        vals = [s[key][sub] if sub else s[key] for s in rows[n]]
        return statistics.median(vals)

    ratios = [m["output_throughput"] / f["output_throughput"]
              for f, m in zip(rows[args.few], rows[args.num_adapters], strict=True)]
    table = {str(n): {"tok_s": med(n, "output_throughput"), "ttft_p50_ms": med(n, "ttft_ms", "p50"),
                      "ttft_p99_ms": med(n, "ttft_ms", "p99"),
                      "errors": sum(s["errors"] for s in rows[n])} for n in rows}
    result = {"args": vars(args), "registration_ms_per_adapter": per_adapter * 1e3,
              "models_list_ms": models_s * 1e3, "models_listed": listed, "table": table,
              "throughput_ratio_rounds": ratios,
              "throughput_ratio_median": statistics.median(ratios)}
    print(json.dumps(result, indent=2))
    print("wrote", write_result("many_adapters" + ("-cold" if args.cold else ""), result))


if __name__ == "__main__":
    main()
