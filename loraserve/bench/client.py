"""Async HTTP client: streams /v1/completions from any OpenAI-compatible server.

Times are time.perf_counter() seconds relative to the start of the run, so one run's
requests can be laid on one time axis.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from loraserve.bench.workload import BenchRequest


@dataclass
class RequestResult:
    index: int
    model: str
    adapter: str | None
    input_len: int
    output_len: int  # asked for (max_tokens)
    scheduled: float = 0.0  # planned arrival
    send_time: float = 0.0  # when the request actually left (after the concurrency gate)
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # one per streamed token chunk
    end_time: float = 0.0
    output_tokens: int = 0  # usage.completion_tokens if sent, else the chunk count
    usage_reported: bool = False
    status: int = 0  # HTTP status; 0 if the connection failed
    error: str = ""
    text: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ok=self.ok, ttft=self.ttft, e2e=self.e2e)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestResult:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def build_body(req: BenchRequest, temperature: float, include_usage: bool) -> dict:
    body = {
        "model": req.model,
        "prompt": req.prompt,  # a list of ints is valid OpenAI input: exact prompt length
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
        "ignore_eos": True,  # vLLM/SGLang extension: makes the output length exact
        **req.extra,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def _error_text(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)
        msg = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        return f"HTTP {status}: {msg}"
    except ValueError:
        return f"HTTP {status}: {raw[:500].decode(errors='replace')}"


def _handle_event(res: RequestResult, data: dict, now: float, parts: list[str]) -> None:
    if "error" in data:  # vLLM/SGLang report mid-stream failures as an error event
        err = data["error"]
        res.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return
    if data.get("usage"):
        res.output_tokens = int(data["usage"].get("completion_tokens") or 0)
        res.usage_reported = True
    for choice in data.get("choices") or []:
        text = choice.get("text") or ""
        # A trailing empty chunk that only carries finish_reason is not a token.
        if not text and choice.get("finish_reason") is not None and res.chunk_times:
            continue
        if res.first_token_time is None:
            res.first_token_time = now
        res.chunk_times.append(now)
        parts.append(text)
        break  # n=1: one choice per chunk


async def send_request(
    client: httpx.AsyncClient, url: str, req: BenchRequest, t0: float, *,
    headers: dict | None = None, temperature: float = 0.0, include_usage: bool = True,
) -> RequestResult:
    """Stream one completion; never raises, failures land in .error."""
    res = RequestResult(index=req.index, model=req.model, adapter=req.adapter,
                        input_len=req.input_len, output_len=req.output_len, scheduled=req.arrival)
    parts: list[str] = []
    res.send_time = time.perf_counter() - t0
    try:
        body = build_body(req, temperature, include_usage)
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = _error_text(resp.status_code, await resp.aread())
            else:
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, `event:` lines
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    _handle_event(res, json.loads(payload), time.perf_counter() - t0, parts)
                    if res.error:
                        break
    except Exception as e:  # timeouts, resets, bad JSON: count it, keep the run going
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    res.end_time = time.perf_counter() - t0
    res.text = "".join(parts)
    if not res.usage_reported:
        res.output_tokens = len(res.chunk_times)
    if not res.error and res.first_token_time is None:
        res.error = "no tokens in the stream"
    return res


async def run_requests(
    requests: list[BenchRequest], base_url: str, *, api_key: str | None = None,
    max_concurrency: int | None = None, timeout: float = 600.0, temperature: float = 0.0,
    include_usage: bool = True, on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival offset; returns (results by index, wall seconds)."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # The pool must not be the bottleneck: allow as many connections as requests in flight.
    limits = httpx.Limits(max_connections=max_concurrency or len(requests),
                          max_keepalive_connections=max_concurrency or len(requests))

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            if gate is None:
                res = await send_request(client, url, req, t0, headers=headers,
                                         temperature=temperature, include_usage=include_usage)
            else:
                async with gate:
                    res = await send_request(client, url, req, t0, headers=headers,
                                             temperature=temperature, include_usage=include_usage)
            if on_done:
                on_done(res)
            return res

        tasks = []
        for req in sorted(requests, key=lambda r: r.arrival):
            delay = req.arrival - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return sorted(results, key=lambda r: r.index), wall


async def fetch_base_model(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The base model's id from GET /v1/models: the first entry without a parent."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=timeout) as client:
        resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        resp.raise_for_status()
        models = resp.json().get("data", [])
    for m in models:
        if not m.get("parent"):
            return m["id"]
    raise RuntimeError(f"no base model in {base_url}/v1/models")
