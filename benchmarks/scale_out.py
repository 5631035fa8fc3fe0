"""Scale-out: adapter-affinity routing vs round-robin, 2 replicas, side by side.

64 small adapters (ranks 8 and 16, every module) with zipf 1.5 popularity; each replica keeps
at most 8 in host memory (--max-loaded-loras 8). Each routing policy gets a fresh
`loraserve serve --replicas 2 --routing POLICY` (a local Ray instance) and the same workload
(`loraserve bench`, same seed). Reported per policy: host-cache hit rate (1 - disk loads /
adapter requests that found their adapter in host memory on arrival, summed over the replicas'
/metrics before and after the run), disk loads (reads into host memory, prefetches included),
TTFT p50/p99 and output throughput.

    .venv/bin/python benchmarks/scale_out.py            # full size
    .venv/bin/python benchmarks/scale_out.py --smoke    # a quick check (~2 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, scratch_dir, write_result  # noqa: E402

from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.bench.report import plot_cdfs  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

POLICIES = ("affinity", "round_robin")


class ClusterServer:
    """`loraserve serve --replicas ...` in its own session (Ray's processes go with it)."""

    def __init__(self, args: list[str], port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraserve.cli", "serve", "--port", str(port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> ClusterServer:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError("the cluster did not start")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only its processes
            self.proc.wait()
        self._log.close()


KEYS = ("requests", "host_hits", "loads", "host_evictions")


def adapter_counters(url: str) -> dict[str, dict[str, float]]:
    """Per replica, sums over adapters of the store's per-adapter counters."""
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for key in KEYS:
            if line.startswith(f"loraserve_adapter_{key}_total{{"):
                rid = line.split('replica="', 1)[1].split('"', 1)[0]
                per = out.setdefault(rid, dict.fromkeys(KEYS, 0.0))
                per[key] += float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-adapters", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--request-rate", type=float, default=1.6)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-loaded-loras", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--smoke", action="store_true", help="a quick check: 80 requests")
    args = ap.parse_args()
    if args.smoke:
        args.num_requests, args.input_len, args.output_len, args.request_rate = 80, 32, 8, 4.0
    work = scratch_dir("loraserve-scale-out-")
    model_dir = Path(args.model) if args.model else default_model_dir()
    paths = make_synthetic_adapters(model_dir, work / "adapters", args.num_adapters,
                                    ranks=(8, 16))
    server_args = ["--model", str(model_dir), "--replicas", str(args.replicas),
                   "--max-loaded-loras", str(args.max_loaded_loras), "--max-lora-rank", "16",
                   "--lora-paths", *[f"{p.name}={p}" for p in paths]]
    tag = "scale_out-smoke" if args.smoke else "scale_out"
    results, table = {}, {}
    for i, policy in enumerate(POLICIES):
        out = work / f"{policy}.json"
        with ClusterServer([*server_args, "--routing", policy], 8700 + i,
                           work / f"{policy}.log") as srv:
            before = adapter_counters(srv.url)
            subprocess.run([sys.executable, "-m", "loraserve.cli", "bench", "--base-url",
                            srv.url, "--adapter-prefix", "lora", "--num-adapters",
                            str(args.num_adapters), "--adapter-dist", "zipf", "--zipf-alpha",
                            "1.5", "--num-requests", str(args.num_requests), "--request-rate",
                            str(args.request_rate), "--input-len", str(args.input_len),
                            "--output-len", str(args.output_len), "--label", policy,
                            "--result-json", str(out), "--disable-tqdm", "--quiet"], check=True)
            after = adapter_counters(srv.url)
        results[policy] = json.loads(out.read_text())
        s = results[policy]["summary"]
        per_replica = {rid: {k: after[rid][k] - before.get(rid, {}).get(k, 0.0) for k in KEYS}
                       for rid in after}
        delta = {k: sum(r[k] for r in per_replica.values()) for k in KEYS}
        table[policy] = {
            "host_hit_rate": delta["host_hits"] / delta["requests"] if delta["requests"] else 0,
            "disk_loads": delta["loads"], "adapter_requests": delta["requests"],
            "host_evictions": delta["host_evictions"],
            "per_replica": list(per_replica.values()),
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tok_s": s["output_throughput"], "errors": s["errors"]}
        t = table[policy]
        print(f"{policy:12s} hit {t['host_hit_rate']:.1%}  disk loads {t['disk_loads']:.0f}  "
              f"TTFT p50 {t['ttft_p50_ms']:.0f} ms p99 {t['ttft_p99_ms']:.0f} ms  "
              f"{t['tok_s']:.1f} tok/s  errors {t['errors']}  per replica "
              f"{[(r['requests'], r['host_hits'], r['loads']) for r in t['per_replica']]}",
              flush=True)
    plot_cdfs(results, RESULTS / f"{tag}.png")
    print(json.dumps(table, indent=2))
    print("wrote", write_result(tag, {"args": vars(args), "model": str(model_dir),
                                      "table": table}))


if __name__ == "__main__":
    main()
