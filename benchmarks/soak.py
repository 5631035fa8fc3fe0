"""Soak: a bounded run of everything at once against a live server on loopback.

`loraserve serve` on the bundled SmolLM2-135M with 50 synthetic adapters (two weight versions
each), max_loaded_loras 8, max_loras_per_batch 4; 32 concurrent clients, streaming and not,
random hang-ups and malformed requests; a side task unloading, reloading (same or new weights)
and pinning adapters (benchmarks/soak_traffic.py). Resident memory is sampled throughout.

At the end it checks: zero 5xx; every 4xx OpenAI-shaped; a sample of completed answers equal
to the offline API's answer alone for the weights they ran on; the invariant check
(/debug/invariants) passes with no KV block or refcount held; resident memory after the run
within 10% of after warm-up. Results in docs/bench-results/soak.json.

    .venv/bin/python benchmarks/soak.py [--duration 300] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import Server, rss_mb, write_result  # noqa: E402
from soak_traffic import PROMPTS, Tally, churn, client  # noqa: E402

from loraserve.bench.make_adapters import make_synthetic_adapters  # noqa: E402
from loraserve.model.bundled import default_model_dir  # noqa: E402

ADMIN = "soak-admin"


async def drive(url: str, pid: int, paths: dict, args, tally: Tally) -> dict:
    names = sorted(paths)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits,
                                 headers=admin) as http:
        base = (await http.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        t0 = time.monotonic()
        # warm-up: every adapter once (each reaches host memory and is evicted again)
        warm_end = t0 + args.warmup
        await asyncio.gather(*(client(http, names, base, warm_end, tally,
                                      random.Random(rng.random()), ADMIN)
                               for _ in range(args.clients)))
        # and every KV block once (its pages become resident on first use, not at start)
        vocab_ids = [random.Random(k).sample(range(100, 40000), 2000) for k in range(16)]
        await asyncio.gather(*(http.post("/v1/completions", json={
            "model": base, "prompt": ids, "max_tokens": 1}) for ids in vocab_ids))
        await idle(http)
        rss = {"after_warmup": rss_mb(pid), "samples": []}
        deadline = time.monotonic() + args.duration

        async def sample():
            while time.monotonic() < deadline:
                await asyncio.sleep(10)
                rss["samples"].append(round(rss_mb(pid), 1))

        tasks = [client(http, names, base, deadline, tally, random.Random(rng.random()), ADMIN)
                 for _ in range(args.clients)]
        tasks += [churn(http, paths, deadline, tally, random.Random(rng.random()), admin),
                  sample()]
        await asyncio.gather(*tasks)
        state = await idle(http)
        rss["after_run"] = rss_mb(pid)
        report = (await http.get("/debug/invariants")).json()
        return {"rss_mb": rss, "invariants": report, "state": state}


async def idle(http: httpx.AsyncClient, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = (await http.get("/debug/state")).json()
        if not (s["running"] or s["waiting"] or s["kv_blocks_used"]
                or any(a["refcount"] for a in s["adapters"])):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout}s: {s}")
        await asyncio.sleep(0.2)


def candidates(tally: Tally, rec) -> set[str]:
    """The weight versions the adapter's name had at some moment while the request ran."""
    log = tally.versions[rec.adapter]
    out = set()
    for k, (since, path) in enumerate(log):
        until = log[k + 1][0] if k + 1 < len(log) else float("inf")
        if since <= rec.done and until >= rec.sent and path is not None:
            out.add(path)
    return out


def verify(model_dir: Path, tally: Tally, sample: int, seed: int) -> dict:
    """Recompute a sample of answers offline, each alone, on its candidate weights."""
    from loraserve import LLM, SamplingParams

    rng = random.Random(seed)
    recs = rng.sample(tally.records, min(sample, len(tally.records)))
    llm = LLM(str(model_dir))
    loaded: dict[str, str] = {}
    ok = ambiguous = 0
    bad = []
    for rec in recs:
        sp = SamplingParams(max_tokens=rec.max_tokens, temperature=0.0)
        cands = [None] if rec.adapter is None else sorted(candidates(tally, rec))
        ambiguous += len(cands) > 1
        texts = set()
        for path in cands:
            if path is not None and path not in loaded:
                loaded[path] = f"v{len(loaded)}"
                llm.load_lora_adapter(loaded[path], path)
            out = llm.generate([PROMPTS[rec.prompt]], sp, lora=loaded.get(path))[0]
            texts.add(out.text)
        if rec.text in texts:
            ok += 1
        else:
            bad.append({"adapter": rec.adapter, "prompt": rec.prompt, "got": rec.text,
                        "offline": sorted(texts)})
    return {"checked": len(recs), "equal": ok, "ambiguous_version": ambiguous,
            "mismatches": bad[:10]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=300, help="seconds of soak after warm-up")
    ap.add_argument("--smoke", action="store_true", help="a ~30 s run (checks the script)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument("--warmup", type=float, default=30)
    ap.add_argument("--sample", type=int, default=120, help="answers recomputed offline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-log", type=Path, help="copy the server's log here")
    args = ap.parse_args()
    if args.smoke:
        args.duration, args.warmup, args.sample = 20, 8, 30
    model = default_model_dir()
    tally = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        v1 = make_synthetic_adapters(model, Path(tmp) / "v1", args.adapters, ranks=(8, 16),
                                     seed=1, prefix="soak")
        v2 = make_synthetic_adapters(model, Path(tmp) / "v2", args.adapters, ranks=(16, 8),
                                     seed=2, prefix="soak")
        paths = {p.name: [str(p), str(q)] for p, q in zip(v1, v2, strict=True)}
        loras = [f"{n}={ps[0]}" for n, ps in paths.items()]
        server = Server("--max-loaded-loras", "8", "--max-loras-per-batch", "4",
                        "--admin-api-key", ADMIN, "--lora-paths", *loras,
                        log_path=Path(tmp) / "server.log")
        with server:
            t0 = time.monotonic()
            run = asyncio.run(drive(server.url, server.proc.pid, paths, args, tally))
            wall = time.monotonic() - t0
            log = (Path(tmp) / "server.log").read_text(errors="replace")
        if args.keep_log:
            args.keep_log.write_text(log)
        run["verify"] = verify(model, tally, args.sample, args.seed)
    return report(run, tally, args, wall, "Traceback" in log)


def report(run: dict, tally: Tally, args, wall: float, traceback: bool) -> int:
    by_code: dict[str, int] = {}
    for (kind, code), n in sorted(tally.statuses.items()):
        by_code[f"{kind} {code}"] = n
    rss = run["rss_mb"]
    growth = rss["after_run"] / rss["after_warmup"] - 1
    five = sum(n for (_, code), n in tally.statuses.items() if code >= 500)
    inv = run["invariants"]
    checks = {
        "zero_5xx": five == 0,
        "every_4xx_openai_shaped": not tally.bad_errors,
        "sample_equals_offline": run["verify"]["equal"] == run["verify"]["checked"],
        "invariants_ok": inv["ok"],
        "no_kv_or_refcount_leak": inv["kv_blocks_held"] == 0 and inv["adapter_refs"] == 0,
        "rss_within_10pct": abs(growth) <= 0.10,
        "no_traceback_in_log": not traceback,
    }
    out = {"duration_s": args.duration, "warmup_s": args.warmup, "wall_s": round(wall, 1),
           "clients": args.clients, "adapters": args.adapters,
           "requests": sum(tally.statuses.values()), "by_kind_and_status": by_code,
           "faults": dict(tally.faults), "completed_recorded": len(tally.records),
           "rss_mb": rss, "rss_growth": round(growth, 4), "verify": run["verify"],
           "invariants": inv, "bad_errors": [repr(b) for b in tally.bad_errors[:5]],
           "checks": checks}
    path = write_result("soak-smoke" if args.smoke else "soak", out)
    for k in ("requests", "by_kind_and_status", "faults", "rss_mb", "rss_growth", "verify",
              "checks"):
        print(f"{k}: {out[k]}")
    print(f"written {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
