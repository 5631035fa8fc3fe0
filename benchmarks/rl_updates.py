"""Adapter updates under sampling traffic, as an RL loop makes them: what do they cost?

One `loraserve serve` on loopback (the bundled SmolLM2-135M), an adapter `policy` of rank 16
on all seven modules. `--clients` clients stream completions from `policy` without pause
(random 64-token prompts, `--max-tokens` sampled tokens, temperature 1, logprobs as an RL
sampler asks for them). Phases of `--phase-s` seconds alternate: off (traffic only) and on
(traffic + a new version of `policy` every `--interval` s, its weights changed, serialized
from memory and sent as a multipart upload with replace, as a trainer pushes them).

Figures:
- throughput: output tokens per second of the traffic in each phase; on/off per pair of
  phases, median over the pairs (target: >= 0.9);
- update latency: from the upload call to the first token any request produces on the new
  version (the updater sends one 1-token request as soon as the upload answers, as a trainer
  sends its next rollouts; traffic requests that start first count too); p50 and p99 over
  the on phases' updates (target: p99 < 1 s);
- memory: the server's RSS and its adapter copies on disk before and after `--updates`
  updates back to back (`--fast-interval` apart) under the same traffic (target: flat).

    .venv/bin/python benchmarks/rl_updates.py            # ~5 minutes
    .venv/bin/python benchmarks/rl_updates.py --smoke    # a quick check of the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save as safetensors_bytes

sys.path.insert(0, str(Path(__file__).parent))
from common import Server, rss_mb, write_result  # noqa: E402

from loraserve.bench.make_adapters import (  # noqa: E402
    ALL_MODULES,
    adapter_config,
    make_adapter_tensors,
    read_model_config,
)
from loraserve.model.bundled import default_model_dir  # noqa: E402
from loraserve.paths import cache_root  # noqa: E402


class Traffic:
    """Clients streaming from `policy` until stopped; every token's arrival time is kept."""

    def __init__(self, http: httpx.AsyncClient, args, vocab: int):
        self.http, self.args = http, args
        self.rng = random.Random(args.seed)
        self.vocab = vocab
        self.token_times: list[float] = []  # traffic tokens only
        self.first_token: dict[int, float] = {}  # version -> first token on it, any request
        self.errors: list[str] = []
        self.stopping = False

    def prompt(self) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 1) for _ in range(self.args.prompt_len)]

    async def stream(self, max_tokens: int, traffic: bool) -> None:
        body = {"model": "policy", "prompt": self.prompt(), "max_tokens": max_tokens,
                "temperature": 1.0, "ignore_eos": True, "stream": True, "logprobs": 0,
                "return_tokens_as_token_ids": True}
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                self.errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                version = int(chunk["model"].rsplit("@", 1)[1])
                if version not in self.first_token:
                    self.first_token[version] = now
                lp = chunk["choices"][0].get("logprobs") or {}
                if traffic:
                    self.token_times.extend([now] * len(lp.get("tokens", [])))

    async def client(self) -> None:
        while not self.stopping:
            try:
                await self.stream(self.args.max_tokens, traffic=True)
            except httpx.HTTPError as e:
                self.errors.append(repr(e))

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(t0 <= t < t1 for t in self.token_times)


class Updater:
    """A trainer's pushes: the adapter's weights changed a little, serialized, uploaded."""

    def __init__(self, http: httpx.AsyncClient, traffic: Traffic, model_cfg: dict, rank: int):
        self.http, self.traffic = http, traffic
        alpha = 2 * rank
        self.tensors = make_adapter_tensors(model_cfg, rank, ALL_MODULES, alpha, seed=1)
        self.config = json.dumps(adapter_config("bundled", rank, alpha, ALL_MODULES)).encode()
        self.records: list[dict] = []
        self.step = 0

    async def push(self, probe: bool = True) -> dict:
        self.step += 1
        t_ser = time.perf_counter()
        # a training step's worth of change: every B moves (and so every fingerprint)
        for k, v in self.tensors.items():
            if k.endswith("lora_B.weight"):
                v.mul_(1.0 + 1e-3 * ((self.step % 7) - 3))
        payload = safetensors_bytes(self.tensors)
        t0 = time.perf_counter()
        r = await self.http.post("/v1/upload_lora_adapter", data={
            "lora_name": "policy", "replace": "true"}, files={
            "config": ("adapter_config.json", self.config),
            "weights": ("adapter_model.safetensors", payload)})
        t_answer = time.perf_counter()
        if r.status_code != 200:
            raise RuntimeError(f"upload refused: {r.status_code} {r.text[:300]}")
        version = r.json()["version"]
        if probe:
            await self.traffic.stream(1, traffic=False)  # the next rollout, sent at once
        rec = {"version": version, "serialize_s": t0 - t_ser, "upload_s": t_answer - t0,
               "first_token_s": self.traffic.first_token.get(version, float("nan")) - t0,
               "payload_mb": len(payload) / 2**20}
        self.records.append(rec)
        return rec

    async def every(self, interval: float, until: float, probe: bool = True) -> list[dict]:
        out = []
        while time.perf_counter() < until:
            t = time.perf_counter()
            out.append(await self.push(probe))
            await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t)))
        return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spill_copies(pid: int) -> int:
    """The server's adapter copies on disk (uploads live there until their version is freed)."""
    return sum(1 for d in (cache_root() / "adapter-copies").glob(f"{pid}-*/*") if d.is_dir())


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def drive(server: Server, args) -> dict:
    model_cfg = read_model_config(default_model_dir())
    load_start = os.getloadavg()  # the host is shared: how busy it was
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
        traffic = Traffic(http, args, model_cfg["vocab_size"])
        updater = Updater(http, traffic, model_cfg, args.rank)
        await updater.push(probe=False)  # policy@1
        # the server's CPU per update, measured with no traffic: what an update takes from
        # sampling wherever the cores are busy (the host's load does not change it much)
        cpu0 = cpu_seconds(server.proc.pid)
        for _ in range(args.quiet_updates):
            await updater.push(probe=False)
        cpu_per_update = (cpu_seconds(server.proc.pid) - cpu0) / args.quiet_updates
        quiet = list(updater.records[1:])
        clients = [asyncio.create_task(traffic.client()) for _ in range(args.clients)]
        await asyncio.sleep(args.warmup_s)
        await updater.every(args.interval, time.perf_counter() + args.warmup_s)  # warm paths
        updater.records.clear()
        rss_warm = rss_mb(server.proc.pid)

        pairs = []
        for i in range(args.pairs):
            phase = {}
            for kind in (("off", "on") if i % 2 == 0 else ("on", "off")):  # ABBA order
                t0 = time.perf_counter()
                until = t0 + args.phase_s
                recs = (await updater.every(args.interval, until) if kind == "on"
                        else await asyncio.sleep(args.phase_s))
                t1 = time.perf_counter()
                phase[kind] = {"tok_s": traffic.tokens_between(t0, t1) / (t1 - t0),
                               "seconds": t1 - t0, "updates": len(recs or [])}
            phase["ratio"] = phase["on"]["tok_s"] / phase["off"]["tok_s"]
            pairs.append(phase)
            print(f"pair {i}: off {phase['off']['tok_s']:.1f} tok/s, on "
                  f"{phase['on']['tok_s']:.1f} tok/s ({phase['on']['updates']} updates): "
                  f"{phase['ratio']:.3f}", flush=True)
        timed = list(updater.records)

        rss_start, copies_start = rss_mb(server.proc.pid), spill_copies(server.proc.pid)
        rss_trace = [rss_start]
        updater.records.clear()
        for j in range(args.updates):
            t = time.perf_counter()
            await updater.push(probe=False)
            if (j + 1) % 20 == 0:
                rss_trace.append(rss_mb(server.proc.pid))
                print(f"{j + 1} updates: RSS {rss_trace[-1]:.0f} MB", flush=True)
            await asyncio.sleep(max(0.0, args.fast_interval - (time.perf_counter() - t)))
        fast = list(updater.records)
        await asyncio.sleep(2 * args.max_tokens * 0.1)  # the last old versions drain
        rss_end, copies_end = rss_mb(server.proc.pid), spill_copies(server.proc.pid)

        traffic.stopping = True
        await asyncio.gather(*clients)
        models = (await http.get("/v1/models")).json()["data"]
        state = (await http.get("/debug/invariants")).json()

    lat = [r["first_token_s"] for r in timed]
    ratios = [p["ratio"] for p in pairs]
    return {
        "workload": {k: getattr(args, k) for k in (
            "clients", "prompt_len", "max_tokens", "phase_s", "pairs", "interval", "updates",
            "fast_interval", "rank")},
        "pairs": pairs,
        "throughput_ratio_on_off_median": statistics.median(ratios),
        "update_latency_s": {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "max": max(lat),
                             "n": len(lat)},
        "upload_call_s": {"p50": pct([r["upload_s"] for r in timed], 0.5),
                          "p99": pct([r["upload_s"] for r in timed], 0.99)},
        "quiet_updates": {"n": len(quiet),
                          "server_cpu_s_per_update": cpu_per_update,
                          "upload_call_s_p50": pct([r["upload_s"] for r in quiet], 0.5)},
        "serialize_s_p50": pct([r["serialize_s"] for r in timed], 0.5),
        "payload_mb": timed[0]["payload_mb"],
        "fast_updates": {"n": len(fast), "upload_call_s_p50": pct([r["upload_s"] for r in fast],
                                                                  0.5),
                         "upload_call_s_p99": pct([r["upload_s"] for r in fast], 0.99),
                         "last_version": fast[-1]["version"] if fast else None},
        "rss_mb": {"after_warmup": rss_warm, "before_updates": rss_start,
                   "after_updates": rss_end, "trace_every_20": rss_trace},
        "adapter_copies_on_disk": {"before_updates": copies_start, "after_updates": copies_end},
        "live_versions_at_end": next((m.get("versions") for m in models
                                      if m["id"] == "policy"), None),
        "invariants": state,
        "traffic_errors": traffic.errors[:10],
        "load_average_start_end": [load_start, os.getloadavg()],
        "timed_updates": timed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--interval", type=float, default=2.0, help="K: seconds between updates")
    p.add_argument("--updates", type=int, default=200, help="back-to-back updates for memory")
    p.add_argument("--fast-interval", type=float, default=0.2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--quiet-updates", type=int, default=10,
                   help="updates with no traffic first, for the server's CPU per update")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny settings: checks the script")
    args = p.parse_args()
    if args.smoke:
        args.phase_s, args.pairs, args.updates, args.warmup_s = 3.0, 1, 10, 1.0
        args.quiet_updates = 3
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, Server(
            "--allow-runtime-lora-updates", "--max-lora-rank", str(args.rank),
            log_path=Path(tmp) / "server.log") as server:
        result = asyncio.run(drive(server, args))
    out = write_result("rl_updates" + ("-smoke" if args.smoke else ""), result)
    lat, mem = result["update_latency_s"], result["rss_mb"]
    print(f"throughput on/off, median of {args.pairs} pairs: "
          f"{result['throughput_ratio_on_off_median']:.3f} (target >= 0.9)")
    print(f"update -> first token on the new version: p50 {lat['p50'] * 1e3:.0f} ms, p99 "
          f"{lat['p99'] * 1e3:.0f} ms over {lat['n']} updates (target p99 < 1 s)")
    q = result["quiet_updates"]
    print(f"with no traffic: upload call p50 {q['upload_call_s_p50'] * 1e3:.0f} ms, server "
          f"CPU {q['server_cpu_s_per_update'] * 1e3:.0f} ms per update")
    print(f"RSS before / after {args.updates} updates: {mem['before_updates']:.0f} / "
          f"{mem['after_updates']:.0f} MB; adapter copies on disk "
          f"{result['adapter_copies_on_disk']}; errors: {len(result['traffic_errors'])}")
    print(f"result: {out}")


if __name__ == "__main__":
    main()
