"""Tenancy: how much one client's load hurts the others, fair scheduling on against off.

A fresh `loraserve serve` on the bundled SmolLM2-135M per configuration; every client has its
own loopback address (the server tells clients apart by address when no API keys are set):
  - long:   7,000-token prompts, one after another (16 output tokens each);
  - fan-out: PROMPTS prompts x n=16 per request, one request after another (32 tokens each);
  - slow:   SLOW streams of 512 tokens whose client reads 256 bytes a second;
  - three well-behaved clients: a short prompt, 16 tokens, one request after another.
First the well-behaved clients run alone (their idle latency), then everyone for DURATION
seconds. Reported: the well-behaved requests' p50/p99 latency and their ratio to the idle
p50; requests still unfinished when the load phase ends count with the time they had waited
(a lower bound, flagged). "on" is the default engine; "off" turns off fair scheduling, the
paced prefill budget and stream backpressure (the scheduler before them). Both use the same
--max-num-seqs (scaled to the host) and --send-buffer-bytes. Configurations alternate.

Target: well-behaved p99 <= 3x idle with fair scheduling on.

    .venv/bin/python benchmarks/tenancy.py [--duration 150] [--rounds 1] [--prompts 4]
        [--max-num-seqs 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import Server, scratch_dir, write_result  # noqa: E402

COMMON = ["--send-buffer-bytes", "8192"]
CONFIGS = {
    "on": [],
    "off": ["--disable-fair-scheduling", "--decode-pace-factor", "0",
            "--max-unread-outputs", "0"],
}
SHORT = {"prompt": "Write one sentence about the sea.", "max_tokens": 16, "ignore_eos": True}


def client(address: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=address),
                             timeout=httpx.Timeout(900.0))


async def well_behaved(url: str, address: str, until: float, out: list, think_s: float,
                       stream: bool):
    """Sequential short requests until `until`; (latency, finished, time to first token) per
    request (streamed, the first token's time is seen; whole answers: it is the latency)."""
    async with client(address) as c:
        while time.monotonic() < until:
            start = time.monotonic()
            first: list[float] = []
            task = asyncio.ensure_future(_read_stream(c, url, start, first) if stream
                                         else _read_whole(c, url, start, first))
            done, _ = await asyncio.wait({task}, timeout=max(0.0, until - start) + 5.0)
            if not done:  # still waiting when the phase ended: a lower bound
                task.cancel()
                now = time.monotonic() - start
                out.append((now, False, first[0] if first else now))
                return
            task.result()
            out.append((time.monotonic() - start, True, first[0]))
            await asyncio.sleep(think_s)


async def _read_whole(c: httpx.AsyncClient, url: str, start: float, first: list) -> None:
    (await c.post(url + "/v1/completions", json=SHORT)).raise_for_status()
    first.append(time.monotonic() - start)


async def _read_stream(c: httpx.AsyncClient, url: str, start: float, first: list) -> None:
    async with c.stream("POST", url + "/v1/completions", json={**SHORT, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and not first:
                first.append(time.monotonic() - start)


async def repeat(url: str, address: str, body: dict):
    """The same request, one after another, forever (cancelled at the end of the phase)."""
    async with client(address) as c:
        while True:
            try:
                await c.post(url + "/v1/completions", json=body)
            except httpx.HTTPError:
                await asyncio.sleep(1.0)


async def slow_stream(port: int, address: str, bytes_per_s: int):
    """A streaming request whose client reads `bytes_per_s` a second (a small window)."""
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 512, "stream": True,
                       "ignore_eos": True}).encode()
    while True:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.bind((address, 0))
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=bytes_per_s)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        data = b""
        try:
            while b"[DONE]" not in data[-64:]:
                chunk = await reader.read(bytes_per_s)
                if not chunk:
                    break
                data = data[-64:] + chunk
                await asyncio.sleep(1.0)
        finally:
            writer.close()


async def sample_state(url: str, seen: dict):
    """The most requests running, waiting and paused at once (every 2 s)."""
    async with httpx.AsyncClient(timeout=600) as c:
        while True:
            try:  # answered between steps: a long step delays it
                state = (await c.get(url + "/debug/state")).json()
            except httpx.HTTPError:
                continue
            for k in ("running", "waiting", "paused"):
                seen[k] = max(seen.get(k, 0), state[k])
            await asyncio.sleep(2.0)


def stats(samples: list[tuple[float, bool, float]], idle: float) -> dict:
    lat = sorted(s[0] for s in samples)
    ttft = sorted(s[2] for s in samples)
    return {"n": len(lat), "unfinished": sum(1 for s in samples if not s[1]),
            "p50_s": round(statistics.median(lat), 3), "p99_s": round(_p99(lat), 3),
            "p50_over_idle": round(statistics.median(lat) / idle, 2),
            "p99_over_idle": round(_p99(lat) / idle, 2),
            "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_p99_s": round(_p99(ttft), 3)}


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]


async def run_config(url: str, port: int, args) -> dict:
    wb = ["127.0.0.5", "127.0.0.6", "127.0.0.7"]
    idle: list = []
    until = time.monotonic() + args.idle_s
    await asyncio.gather(*(well_behaved(url, a, until, idle, 0.0, args.stream) for a in wb))
    idle_p50 = statistics.median(s[0] for s in idle)
    long_prompt = [1000 + (7919 * i) % 40000 for i in range(args.long_tokens)]
    heavy = [
        asyncio.ensure_future(repeat(url, "127.0.0.2", {"prompt": long_prompt, "max_tokens": 16,
                                                        "ignore_eos": True})),
        asyncio.ensure_future(repeat(url, "127.0.0.3", {
            "prompt": [f"Story number {i} begins" for i in range(args.prompts)], "n": 16,
            "max_tokens": 32, "ignore_eos": True, "temperature": 1.0})),
        *(asyncio.ensure_future(slow_stream(port, "127.0.0.4", 256)) for _ in range(args.slow)),
    ]
    seen: dict = {}
    heavy.append(asyncio.ensure_future(sample_state(url, seen)))
    await asyncio.sleep(args.warmup_s)  # the heavy clients are in flight
    loaded: list = []
    until = time.monotonic() + args.duration
    await asyncio.gather(*(well_behaved(url, a, until, loaded, 0.2, args.stream) for a in wb))
    for t in heavy:
        t.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)
    return {"idle": stats(idle, idle_p50), "loaded": stats(loaded, idle_p50),
            "idle_p50_s": round(idle_p50, 3), "most_at_once": seen}


def cpu_ticks() -> list[int]:
    """The host's CPU time counters (/proc/stat): steal, time the hypervisor gave this VM's
    CPUs to others, slows every step without showing in the load average."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def steal_pct(before: list[int], after: list[int]) -> float:
    d = [a - b for a, b in zip(after, before, strict=True)]
    return round(100.0 * d[7] / max(1, sum(d)), 1)  # field 8: steal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=150.0, help="load phase, seconds")
    ap.add_argument("--idle-s", type=float, default=20.0, help="idle phase, seconds")
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4, help="fan-out prompts (x n=16)")
    ap.add_argument("--slow", type=int, default=24, help="slow-reading streams")
    ap.add_argument("--long-tokens", type=int, default=7000)
    ap.add_argument("--configs", default="on,off")
    ap.add_argument("--whole", dest="stream", action="store_false",
                    help="the well-behaved clients ask for whole answers instead of streams")
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="the server's --max-num-seqs, both configurations (scaled to the host)")
    ap.add_argument("--server-flags", default="",
                    help='more server flags for every configuration, e.g. '
                         '"--tenant-pace-factor 1.25"')
    args = ap.parse_args()
    tmp = scratch_dir("tenancy")
    results: dict[str, list] = {}
    for r in range(args.rounds):
        for name in args.configs.split(","):
            flags = [*COMMON, "--max-num-seqs", str(args.max_num_seqs), *CONFIGS[name],
                     *args.server_flags.split()]
            load_before = os.getloadavg()[0]  # other jobs on the host inflate every ratio
            steal_before = cpu_ticks()
            with Server(*flags, log_path=tmp / f"{name}-{r}.log") as srv:
                res = asyncio.run(run_config(srv.url, srv.port, args))
            res["host_load_1min"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
            res["steal_pct"] = steal_pct(steal_before, cpu_ticks())
            results.setdefault(name, []).append(res)
            print(f"round {r} {name}: idle p50 {res['idle_p50_s']} s; loaded "
                  f"{json.dumps(res['loaded'])}; most at once {res['most_at_once']}; host load "
                  f"{res['host_load_1min']}; steal {res['steal_pct']}%", flush=True)
    name = "tenancy" if args.max_num_seqs == 16 else f"tenancy-seqs{args.max_num_seqs}"
    name += "" if args.stream else "-whole"
    path = write_result(name, {"args": vars(args), "server_flags": COMMON,
                                    "configs": CONFIGS, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
