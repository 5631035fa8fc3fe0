"""Bench load generator against a fake in-process OpenAI-compatible streaming server."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loraserve.bench.cli import add_bench_args, main, run_bench
from loraserve.bench.report import load_run, plot_cdfs
from loraserve.bench.workload import (
    WorkloadConfig,
    arrival_times,
    bursty_groups,
    default_burst_groups,
    generate_workload,
)

BASE = "fake-base"
ADAPTERS = [f"ad{i}" for i in range(8)]


class FakeServer:
    """Streams max_tokens chunks; 404 for unknown models; 'midfail' errors mid-stream."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.in_flight = self.peak = 0
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)

    async def models(self) -> dict:
        data = [{"id": BASE, "parent": None}]
        return {"data": data + [{"id": a, "parent": BASE} for a in ADAPTERS]}

    async def completions(self, request: Request):
        body = await request.json()
        self.seen.append(body)
        model, n = body["model"], body["max_tokens"]
        if model not in ADAPTERS + [BASE, "midfail"]:
            err = {"message": f"model {model} not found", "type": "NotFoundError", "code": 404}
            return JSONResponse({"error": err}, status_code=404)
        usage = (body.get("stream_options") or {}).get("include_usage")

        async def events():
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                for i in range(n):
                    await asyncio.sleep(0.002)
                    if model == "midfail" and i == 1:
                        yield f"data: {json.dumps({'error': {'message': 'boom'}})}\n\n"
                        return
                    fin = "length" if i == n - 1 else None
                    choice = {"index": 0, "text": f" t{i}", "finish_reason": fin}
                    yield f"data: {json.dumps({'model': model, 'choices': [choice]})}\n\n"
                if usage:
                    u = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                    yield f"data: {json.dumps({'choices': [], 'usage': u})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not srv.started and time.time() < deadline:
        time.sleep(0.01)
    assert srv.started
    yield f"http://127.0.0.1:{port}", fake
    srv.should_exit = True
    th.join(5)
    sock.close()


def bench_args(url: str, *extra: str) -> argparse.Namespace:
    p = add_bench_args(argparse.ArgumentParser())
    return p.parse_args(["--base-url", url, "--disable-tqdm", "--quiet", *extra])


# ---------------------------------------------------------------- end to end over HTTP


def test_bench_rate_inf_with_base_requests(server, tmp_path):
    url, fake = server
    fake.seen.clear()
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    run = run_bench(bench_args(
        url, "--adapters", ",".join(ADAPTERS), "--num-requests", "20", "--input-len", "16",
        "--output-len", "5", "--base-fraction", "0.25", "--result-json", str(js),
        "--plot", str(png), "--label", "inf"))
    s = run["summary"]
    assert (s["num_requests"], s["completed"], s["errors"]) == (20, 20, 0)
    assert s["output_tokens"] == 100 and s["input_tokens"] == 320
    reqs = run["requests"]
    assert all(r["ttft"] <= r["e2e"] for r in reqs)
    assert all(len(r["chunk_times"]) == 5 and r["usage_reported"] for r in reqs)
    # base model name came from /v1/models; exactly 5 base requests
    assert sum(r["model"] == BASE and r["adapter"] is None for r in reqs) == 5
    assert set(run["per_adapter"]) == {r["model"] for r in reqs}
    assert run["per_adapter"][BASE]["base"] and run["per_adapter"][BASE]["requests"] == 5
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"] and s["itl_ms"]["p99"] is not None
    # what went over the wire: exact token-id prompts, ignore_eos, usage requested
    assert len(fake.seen) == 20
    for body in fake.seen:
        assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 5
        assert len(body["prompt"]) == 16 and all(isinstance(t, int) for t in body["prompt"])
        assert body["stream_options"] == {"include_usage": True}
    assert load_run(js)["summary"]["completed"] == 20
    assert png.stat().st_size > 1000


def test_bench_poisson_random_lengths_no_usage(server):
    url, _ = server
    rate = 200.0
    run = run_bench(bench_args(
        url, "--adapter-prefix", "ad", "--num-adapters", "8", "--num-requests", "20",
        "--request-rate", str(rate), "--output-len", "2", "--output-len-max", "6",
        "--input-len", "4", "--input-len-max", "12", "--no-usage", "--adapter-dist", "zipf",
        "--max-concurrency", "4", "--seed", "3"))
    s = run["summary"]
    assert s["completed"] == 20 and s["errors"] == 0
    for r in run["requests"]:
        assert not r["usage_reported"] and r["output_tokens"] == r["output_len"]
        assert 2 <= r["output_len"] <= 6 and 4 <= r["input_len"] <= 12
        assert r["ttft"] <= r["e2e"]
        assert r["send_time"] >= r["scheduled"] - 1e-3  # never sent before its arrival
    assert s["duration_s"] >= max(r["scheduled"] for r in run["requests"])


def test_max_concurrency_respected(server):
    url, fake = server
    fake.peak = 0
    run_bench(bench_args(url, "--adapters", "ad0,ad1", "--num-requests", "12",
                         "--output-len", "8", "--max-concurrency", "3"))
    assert 1 <= fake.peak <= 3


def test_server_errors_are_counted(server):
    url, _ = server
    run = run_bench(bench_args(url, "--adapters", "ad0,nope,midfail", "--num-requests", "9",
                               "--adapter-dist", "distinct", "--output-len", "4"))
    s = run["summary"]
    assert (s["completed"], s["errors"]) == (3, 6)
    pa = run["per_adapter"]
    assert pa["nope"]["errors"] == 3 and pa["midfail"]["errors"] == 3 and pa["ad0"]["errors"] == 0
    errs = {r["model"]: r["error"] for r in run["requests"] if r["error"]}
    assert "404" in errs["nope"] and "not found" in errs["nope"]
    assert errs["midfail"] == "boom"
    assert all(r["status"] == 404 for r in run["requests"] if r["model"] == "nope")


def test_unreachable_server_is_errors_not_crash():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    run = run_bench(bench_args(f"http://127.0.0.1:{port}", "--adapters", "x",
                               "--num-requests", "3", "--timeout", "5"))
    assert run["summary"]["errors"] == 3 and run["summary"]["completed"] == 0


def test_plot_cdfs_overlays_runs(server, tmp_path):
    url, _ = server
    runs = {}
    for label, rate in (("fast", "inf"), ("slow", "100")):
        js = tmp_path / f"{label}.json"
        run_bench(bench_args(url, "--adapters", "ad0,ad1", "--num-requests", "6",
                             "--output-len", "3", "--request-rate", rate,
                             "--result-json", str(js)))
        runs[label] = load_run(js)
    out = plot_cdfs(runs, tmp_path / "cmp" / "cdf.png")
    assert out.exists() and out.stat().st_size > 1000


def test_standalone_entry_points(server, capsys):
    url, _ = server
    run = main(["--base-url", url, "--adapters", "ad0", "--num-requests", "2",
                "--output-len", "2", "--disable-tqdm", "--prompt-mode", "text"])
    assert run["summary"]["completed"] == 2
    assert "TTFT" in capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-m", "loraserve.bench", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--adapter-dist" in proc.stdout


# ---------------------------------------------------------------- workload generator


def cfg(**kw) -> WorkloadConfig:
    kw.setdefault("adapters", tuple(f"a{i}" for i in range(40)))
    return WorkloadConfig(**kw)


def test_poisson_and_fixed_arrivals():
    rng = np.random.default_rng(0)
    t = arrival_times(20000, 50.0, "poisson", rng)
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 1 / 50) < 0.02 * (1 / 50)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: cv = 1
    assert np.allclose(np.diff(arrival_times(10, 4.0, "fixed", rng)), 0.25)
    assert not arrival_times(5, float("inf"), "poisson", rng).any()


def test_uniform_and_distinct():
    reqs = generate_workload(cfg(num_requests=8000, adapter_dist="uniform", seed=1))
    counts = np.unique([r.adapter for r in reqs], return_counts=True)[1]
    assert len(counts) == 40 and counts.min() > 0.7 * 200 and counts.max() < 1.3 * 200
    reqs = generate_workload(cfg(num_requests=100, adapter_dist="distinct"))
    assert [r.adapter for r in reqs] == [f"a{i % 40}" for i in range(100)]


def test_zipf_head_heavier_than_tail():
    reqs = generate_workload(cfg(num_requests=5000, adapter_dist="zipf", zipf_alpha=1.2))
    names = [r.adapter for r in reqs]
    c = {a: names.count(a) for a in (f"a{i}" for i in range(40))}
    assert c["a0"] > c["a1"] > c["a3"] > c["a20"]
    assert sum(c[f"a{i}"] for i in range(4)) > sum(c[f"a{i}"] for i in range(20, 40))
    # rank-1 share close to 1/H(40, 1.2)
    h = sum(1 / k**1.2 for k in range(1, 41))
    assert abs(c["a0"] / 5000 - 1 / h) < 0.03


def test_bursty_group_boundaries():
    names = [f"a{i}" for i in range(40)]
    assert default_burst_groups(40) == [10, 20, 30, 40]
    assert default_burst_groups(8) == [2, 4, 6, 8]
    groups = bursty_groups(names, 5, [10, 20, 30, 40])
    assert groups[0] == names[0:10] and groups[1] == names[10:30]
    assert groups[2] == names[30:40] + names[0:20]  # wraps around the list
    assert groups[3] == names[20:40] + names[0:20] and groups[4] == names[20:30]
    reqs = generate_workload(cfg(num_requests=400, adapter_dist="bursty", burst_size=100,
                                 burst_groups=(10, 20)))
    for b, allowed in enumerate([names[0:10], names[10:30], names[30:40], names[0:20]]):
        used = {r.adapter for r in reqs[b * 100:(b + 1) * 100]}
        assert used <= set(allowed) and len(used) >= 0.8 * len(allowed)


def test_base_fraction_lengths_prompts_and_determinism():
    c = cfg(num_requests=200, base_fraction=0.3, base_model="B", input_len=8,
            input_len_max=24, output_len=5, shared_prefix_len=4, seed=7)
    reqs = generate_workload(c)
    base = [r for r in reqs if r.adapter is None]
    assert len(base) == 60 and all(r.model == "B" for r in base)
    assert all(r.model == r.adapter for r in reqs if r.adapter)
    assert all(len(r.prompt) == r.input_len and 8 <= r.input_len <= 24 for r in reqs)
    assert len({r.input_len for r in reqs}) > 5 and all(r.output_len == 5 for r in reqs)
    assert len({tuple(r.prompt[:4]) for r in reqs}) == 1  # shared prefix
    assert len({tuple(r.prompt[4:8]) for r in reqs}) > 100  # the rest differs
    assert all(100 <= t < 10000 for r in reqs for t in r.prompt)
    again = generate_workload(c)
    assert [(r.model, r.prompt, r.arrival) for r in reqs] == \
        [(r.model, r.prompt, r.arrival) for r in again]
    text = generate_workload(cfg(num_requests=3, prompt_mode="text", input_len=12))
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 for r in text)
    only_base = generate_workload(WorkloadConfig(num_requests=4, base_model="B"))
    assert all(r.model == "B" and r.adapter is None for r in only_base)
    with pytest.raises(ValueError):
        WorkloadConfig(adapter_dist="nope")
