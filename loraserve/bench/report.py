"""Metrics, summary table, JSON results and CDF plots for bench runs.

A "run" here is the dict run_bench returns (and writes as JSON): {"label", "config",
"summary", "per_adapter", "requests": [RequestResult.to_dict(), ...]}.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from loraserve.bench.client import RequestResult

PCTS = (50, 90, 99)


def stats(xs: list[float]) -> dict:
    """mean/p50/p90/p99 in milliseconds (inputs in seconds); None when empty."""
    if not xs:
        return {"mean": None, **{f"p{p}": None for p in PCTS}}
    a = np.asarray(xs, dtype=np.float64) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PCTS}}


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    # TPOT: decode time per output token after the first, per request.
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors: dict[str, int] = defaultdict(int)
    for r in results:
        if not r.ok:
            errors[r.error[:200]] += 1
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_kinds": dict(errors),
        "duration_s": wall_s,
        "input_tokens": sum(r.input_len for r in ok),
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_throughput": out_tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": stats([r.ttft for r in ok]),
        "itl_ms": stats([x for r in ok for x in r.itls]),
        "tpot_ms": stats(tpots),
        "e2e_ms": stats([r.e2e for r in ok]),
    }


def per_adapter(results: list[RequestResult]) -> dict[str, dict]:
    """Latency per `model` value (adapter name, or the base model's name)."""
    by: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        by[r.model].append(r)
    table = {}
    for name in sorted(by):
        rs = by[name]
        ok = [r for r in rs if r.ok]
        ttft, e2e = stats([r.ttft for r in ok]), stats([r.e2e for r in ok])
        table[name] = {
            "base": rs[0].adapter is None, "requests": len(rs), "errors": len(rs) - len(ok),
            "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"],
            "e2e_p50_ms": e2e["p50"], "e2e_p99_ms": e2e["p99"],
        }
    return table


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_summary(run: dict, max_adapter_rows: int = 40) -> str:
    s = run["summary"]
    lines = [
        f"==== loraserve bench: {run.get('label') or 'run'} ====",
        f"requests: {s['num_requests']}  completed: {s['completed']}  errors: {s['errors']}",
        f"duration: {s['duration_s']:.2f} s  input tokens: {s['input_tokens']}  "
        f"output tokens: {s['output_tokens']}",
        f"request throughput: {s['request_throughput']:.2f} req/s  "
        f"output throughput: {s['output_throughput']:.1f} tok/s",
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in ("ttft", "itl", "tpot", "e2e"):
        st = s[f"{key}_ms"]
        lines.append(f"{key.upper():<12}" + "".join(
            f"{_ms(st[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    for msg, count in s["error_kinds"].items():
        lines.append(f"error x{count}: {msg}")
    table = run.get("per_adapter") or {}
    if table:
        lines.append(f"{'model':<24}{'reqs':>6}{'errs':>6}{'TTFT p50':>10}{'TTFT p99':>10}"
                     f"{'E2E p50':>10}")
        rows = list(table.items())
        for name, row in rows[:max_adapter_rows]:
            tag = name + (" (base)" if row["base"] else "")
            lines.append(f"{tag[:23]:<24}{row['requests']:>6}{row['errors']:>6}"
                         f"{_ms(row['ttft_p50_ms']):>10}{_ms(row['ttft_p99_ms']):>10}"
                         f"{_ms(row['e2e_p50_ms']):>10}")
        if len(rows) > max_adapter_rows:
            lines.append(f"... {len(rows) - max_adapter_rows} more models in the JSON file")
    return "\n".join(lines)


def write_json(run: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1))
    return path


def load_run(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def _requests_of(run) -> list[RequestResult]:
    """Accept a run dict (fresh or loaded from JSON) or a plain list of results."""
    items = run["requests"] if isinstance(run, dict) else run
    return [r if isinstance(r, RequestResult) else RequestResult.from_dict(r) for r in items]


def plot_cdfs(results: dict[str, dict | list], out_png: str | Path) -> Path:
    """Overlay the TTFT and E2E latency CDFs of several runs, one line per label."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, run in results.items():
        ok = [r for r in _requests_of(run) if r.ok]
        for ax, xs in zip(axes, ([r.ttft for r in ok], [r.e2e for r in ok]), strict=True):
            if not xs:
                continue
            a = np.sort(np.asarray(xs) * 1000.0)
            ax.step(a, np.arange(1, len(a) + 1) / len(a), where="post", label=label)
    for ax, title in zip(axes, ("TTFT", "End-to-end latency"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
