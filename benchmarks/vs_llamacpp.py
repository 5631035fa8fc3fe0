"""loraserve against llama.cpp's `llama-server`, side by side, over HTTP, at equal formats.

llama.cpp is built from the pinned source package (benchmarks/llamacpp_build.py); the bundled
model and synthetic PEFT adapters are converted with its own converters. Both servers run at
once on the same threads (`--threads`); each round sends the same token-id prompts to one,
then the other (which goes first alternates), over kept-alive connections. Three workloads,
output tokens per second:

- batch1: one request at a time (32 prompt tokens, 128 out);
- base32: 32 concurrent requests to the base model (128 in, 64 out);
- lora32: 32 concurrent requests over 5 adapters, round robin (llama.cpp: the per-request
  `lora` field of /completion; it runs requests with different adapters apart).

The timed requests ask for no logprobs (ours counts its tokens by the response's usage,
llama.cpp returns its token ids at no cost); the agreement check asks ours for logprobs to
get token ids back.

Formats (`--formats`): f32 (loraserve float32 / GGUF F32), q8_0 (`--quantization int8` /
Q8_0 from the converter), q4_0 (`--quantization int4` / Q4_0 by llama-quantize, its default
mix). Greedy outputs of a few prompts are compared on f32 (token agreement reported).

    .venv/bin/python benchmarks/vs_llamacpp.py [--formats f32,q8_0,q4_0] [--reps 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp_build as lcpp  # noqa: E402
from common import Server, median, random_prompts, scratch_dir, write_result  # noqa: E402

from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

# format -> loraserve's flags, or None where this checkout has no such flag
OURS_FLAGS = {"f32": ["--dtype", "float32"], "q8_0": ["--quantization", "int8"],
              "q4_0": ["--quantization", "int4"]}
WORKLOADS = {"batch1": (1, 32, 128, False), "base32": (32, 128, 64, False),
             "lora32": (32, 128, 64, True)}  # concurrency, prompt, output, adapters
NUM_ADAPTERS, SLOT_CTX = 5, 256


def pooled_client() -> httpx.Client:
    """Kept-alive connections for every concurrent request, as an API client keeps them: a
    new client per request spends the shared cores on its own set-up (an SSL context each)
    while the servers compute, and the first step of every burst paid for it."""
    conc = max(c for c, *_ in WORKLOADS.values())
    return httpx.Client(timeout=600, limits=httpx.Limits(max_connections=conc,
                                                         max_keepalive_connections=conc))


class LlamaServer:
    """llama-server on a free loopback port with every adapter loaded at scale 0."""

    def __init__(self, binary: Path, model: Path, adapters: list[Path], threads: int,
                 log_path: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        par = max(c for c, *_ in WORKLOADS.values())
        cmd = [str(binary), "-m", str(model), "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-np", str(par), "-c", str(par * SLOT_CTX), "--no-webui",
               "--lora-init-without-apply", "--lora", ",".join(str(a) for a in adapters)]
        self.num_adapters = len(adapters)
        self.http = pooled_client()
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def __enter__(self) -> LlamaServer:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError("llama-server did not start")
        # every adapter at scale 0 unless a request names it: --lora-init-without-apply alone
        # left them at 1.0, so base requests ran all of them
        zero = [{"id": i, "scale": 0.0} for i in range(self.num_adapters)]
        httpx.post(self.url + "/lora-adapters", json=zero, timeout=10).raise_for_status()
        loaded = httpx.get(self.url + "/lora-adapters", timeout=10).json()
        if [a["scale"] for a in loaded] != [0.0] * self.num_adapters:
            raise RuntimeError(f"llama-server's adapters: {loaded}")
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(30)
        self._log.close()

    def complete(self, prompt: list[int], n: int, adapter: int | None) -> list[int]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
        if adapter is not None:
            body["lora"] = [{"id": adapter, "scale": 1.0}]
        r = self.http.post(self.url + "/completion", json=body)
        r.raise_for_status()
        return r.json()["tokens"]

    def generate(self, prompt: list[int], n: int, adapter: int | None) -> int:
        """Output tokens of one greedy completion (its token ids cost llama.cpp nothing)."""
        return len(self.complete(prompt, n, adapter))


class Ours:
    """A loraserve server (common.Server) seen through the same `complete` call."""

    def __init__(self, server: Server, base: str, adapters: list[str]):
        self.server, self.base, self.adapters = server, base, adapters
        self.http = pooled_client()

    def complete(self, prompt: list[int], n: int, adapter: int | None) -> list[int]:
        body = {"model": self.base if adapter is None else self.adapters[adapter],
                "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        r = self.http.post(self.server.url + "/v1/completions", json=body)
        r.raise_for_status()
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        return [int(t.split(":", 1)[1]) for t in tokens]

    def generate(self, prompt: list[int], n: int, adapter: int | None) -> int:
        """Output tokens of one greedy completion, counted by its usage: the token ids come
        only with logprobs here, which a client that does not ask for them does not pay for."""
        body = {"model": self.base if adapter is None else self.adapters[adapter],
                "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
        r = self.http.post(self.server.url + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]


def run_workload(side, name: str, prompts: list[list[int]]) -> float:
    """Output tokens per second of one workload on one server."""
    conc, _, out, lora = WORKLOADS[name]
    jobs = [(p, i % NUM_ADAPTERS if lora else None) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as pool:
        got = list(pool.map(lambda j: side.generate(j[0], out, j[1]), jobs))
    dt = time.perf_counter() - t
    assert all(g == out for g in got), "a server returned fewer tokens than asked"
    return sum(got) / dt


def agreement(ours, theirs, vocab: int, n: int = 32) -> dict:
    """Greedy outputs of both for the same prompts, base model and each adapter: the mean
    share of each output equal before the first difference, and how many are equal in full."""
    routes = [None, *range(NUM_ADAPTERS)] * 2
    prompts = random_prompts(len(routes), 24, vocab, seed=99)
    out: dict = {"tokens": n}
    for kind in ("base", "adapters"):
        shares = []
        for p, route in zip(prompts, routes, strict=True):
            if (route is None) != (kind == "base"):
                continue
            a, b = ours.complete(p, n, route), theirs.complete(p, n, route)
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), n)
            shares.append(same / n)
        out[kind] = {"prompts": len(shares), "mean_prefix_share": sum(shares) / len(shares),
                     "equal_in_full": sum(s == 1.0 for s in shares)}
    return out


def has_quantization_flag() -> bool:
    out = subprocess.run([sys.executable, "-m", "loraserve.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    return "--quantization" in out


def gguf_model(model_dir: Path, fmt: str, quantize_bin: Path | None) -> Path:
    if fmt in ("f32", "q8_0"):
        return lcpp.convert_model(model_dir, fmt)
    return lcpp.quantize_model(lcpp.convert_model(model_dir, "f32"), fmt, quantize_bin)


def bench_format(fmt: str, args, model_dir: Path, adapters: list[Path], binary: Path,
                 quantize_bin: Path | None, logs: Path) -> dict:
    gguf = gguf_model(model_dir, fmt, quantize_bin)
    lora_ggufs = [lcpp.convert_adapter(a, model_dir) for a in adapters]
    names = [a.name for a in adapters]
    lora_flag = [f"{n}={a}" for n, a in zip(names, adapters, strict=True)]
    ours_srv = Server("--model", str(model_dir), "--lora-paths", *lora_flag, "--num-threads",
                      str(args.threads), *OURS_FLAGS[fmt], log_path=logs / f"ours-{fmt}.log")
    with ours_srv, LlamaServer(binary, gguf, lora_ggufs, args.threads,
                               logs / f"llama-{fmt}.log") as theirs:
        models = httpx.get(ours_srv.url + "/v1/models", timeout=30).json()["data"]
        base = next(m["id"] for m in models if m["id"] not in names)
        ours = Ours(ours_srv, base, names)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        sides = {"loraserve": ours, "llama.cpp": theirs}
        for side in sides.values():  # warm-up: every adapter read, kernels built
            for i in range(NUM_ADAPTERS):
                side.complete(random_prompts(1, 8, vocab, seed=7)[0], 2, i)
        res: dict = {"load_before": os.getloadavg()[0]}
        if fmt == "f32":
            res["greedy_agreement"] = agreement(ours, theirs, vocab)
        rates = {(s, w): [] for s in sides for w in WORKLOADS}
        for rep in range(args.reps):
            for w, (conc, plen, _, _) in WORKLOADS.items():
                n = conc if conc > 1 else args.batch1_requests
                prompts = random_prompts(n, plen, vocab, seed=1000 * rep + len(w))
                order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
                for s in order:
                    rates[(s, w)].append(run_workload(sides[s], w, prompts))
            print(f"{fmt} rep {rep}: " + "  ".join(
                f"{s}/{w} {v[-1]:.1f}" for (s, w), v in rates.items()), flush=True)
        for w in WORKLOADS:
            ours_r, theirs_r = rates[("loraserve", w)], rates[("llama.cpp", w)]
            res[w] = {"loraserve_tok_s": median(ours_r), "llamacpp_tok_s": median(theirs_r),
                      "loraserve_runs": ours_r, "llamacpp_runs": theirs_r,
                      "ratio": median([a / b for a, b in zip(ours_r, theirs_r, strict=True)])}
        res["load_after"] = os.getloadavg()[0]
        ours.http.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="f32", help="comma-separated: f32, q8_0, q4_0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch1-requests", type=int, default=2,
                    help="sequential single requests per batch1 round")
    ap.add_argument("--flavour", default="native", choices=sorted(lcpp.FLAVOURS))
    args = ap.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = set(formats) - set(OURS_FLAGS)
    if unknown:
        ap.error(f"unknown formats {sorted(unknown)}; choose from {sorted(OURS_FLAGS)}")
    binary = lcpp.build_server(args.flavour)
    quantize_bin = lcpp.build_tool("llama-quantize", args.flavour) if "q4_0" in formats else None
    model_dir = default_model_dir()
    scratch = scratch_dir("vs_llamacpp_")
    # init_scale: deltas large enough that every adapter changes the greedy tokens
    adapters = make_synthetic_adapters(model_dir, scratch / "adapters", NUM_ADAPTERS,
                                       ranks=[8, 16], init_scale=0.5)
    quant_ok = has_quantization_flag()
    res: dict = {"workload": vars(args), "llamacpp_version": lcpp.VERSION,
                 "llamacpp_binary": str(binary), "formats": {}}
    for fmt in formats:
        if fmt != "f32" and not quant_ok:
            res["formats"][fmt] = "pending: this loraserve has no --quantization flag"
            print(fmt, res["formats"][fmt], flush=True)
            continue
        res["formats"][fmt] = bench_format(fmt, args, model_dir, adapters, binary,
                                           quantize_bin, scratch)
        print(fmt, res["formats"][fmt], flush=True)
    print("wrote", write_result("vs_llamacpp", res))


if __name__ == "__main__":
    main()
