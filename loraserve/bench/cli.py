"""`loraserve bench` arguments and driver. Speaks HTTP only, so it works against any
OpenAI-compatible server (loraserve, vLLM, SGLang)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util

from loraserve.bench.client import fetch_base_model, run_requests
from loraserve.bench.report import format_summary, per_adapter, plot_cdfs, summarize, write_json
from loraserve.bench.workload import (
    ADAPTER_DISTS,
    ARRIVALS,
    PROMPT_MODES,
    WorkloadConfig,
    generate_workload,
)


def _int_list(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def add_bench_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    g.add_argument("--model", default=None,
                   help="base model name for base requests (default: asked from /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: unlimited)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy)")
    g.add_argument("--no-usage", action="store_true",
                   help="do not send stream_options.include_usage; count chunks instead")

    g = p.add_argument_group("workload")
    g.add_argument("--adapters", default=None, help="comma-separated adapter names")
    g.add_argument("--adapter-prefix", default="lora",
                   help="with --num-adapters: names PREFIX0 .. PREFIX{N-1}")
    g.add_argument("--num-adapters", type=int, default=0,
                   help="adapters named by --adapter-prefix (0: use --adapters)")
    g.add_argument("--num-requests", type=int, default=100, help="requests to send")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s; inf sends every request at once")
    g.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                   help="inter-arrival times at --request-rate")
    g.add_argument("--adapter-dist", choices=ADAPTER_DISTS, default="uniform",
                   help="which adapter each request names")
    g.add_argument("--zipf-alpha", type=float, default=1.0,
                   help="skew of --adapter-dist zipf")
    g.add_argument("--burst-size", type=int, default=100, help="requests per burst (bursty)")
    g.add_argument("--burst-groups", type=_int_list, default=None,
                   help="adapter-group sizes per burst, cycled, e.g. 10,20,40 "
                        "(default: growing groups, restarting after the full list)")
    g.add_argument("--base-fraction", type=float, default=0.0,
                   help="fraction of requests sent to the base model")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    g.add_argument("--input-len-max", type=int, default=None,
                   help="given: input length uniform in [input-len, input-len-max]")
    g.add_argument("--output-len", type=int, default=32,
                   help="max_tokens (sent with ignore_eos, so exact)")
    g.add_argument("--output-len-max", type=int, default=None,
                   help="given: output length uniform in [output-len, output-len-max]")
    g.add_argument("--prompt-mode", choices=PROMPT_MODES, default="token-ids",
                   help="token-ids: exact lengths; text: ~1 token per word")
    g.add_argument("--token-id-range", type=_int_list, default=(100, 10000),
                   help="LOW,HIGH range for random prompt token ids")
    g.add_argument("--shared-prefix-len", type=int, default=0,
                   help="leading prompt tokens shared by every request (prefix-cache tests)")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload generator")

    g = p.add_argument_group("output")
    g.add_argument("--label", default=None, help="name of this run in tables and plots")
    g.add_argument("--result-json", default=None, help="write the full results here")
    g.add_argument("--plot", default=None, metavar="PNG", help="write TTFT/E2E CDF plot here")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--quiet", action="store_true", help="do not print the summary")
    return p


def adapter_names(args: argparse.Namespace) -> list[str]:
    if args.adapters:
        return [a.strip() for a in args.adapters.split(",") if a.strip()]
    return [f"{args.adapter_prefix}{i}" for i in range(args.num_adapters)]


def workload_config(args: argparse.Namespace, base_model: str) -> WorkloadConfig:
    lo, hi = args.token_id_range
    return WorkloadConfig(
        num_requests=args.num_requests, request_rate=args.request_rate, arrival=args.arrival,
        adapters=tuple(adapter_names(args)), adapter_dist=args.adapter_dist,
        zipf_alpha=args.zipf_alpha, burst_size=args.burst_size,
        burst_groups=tuple(args.burst_groups) if args.burst_groups else None,
        base_fraction=args.base_fraction, base_model=base_model,
        input_len=args.input_len, input_len_max=args.input_len_max,
        output_len=args.output_len, output_len_max=args.output_len_max,
        prompt_mode=args.prompt_mode, token_id_range=(lo, hi),
        shared_prefix_len=args.shared_prefix_len, seed=args.seed,
    )


def _needs_base(args: argparse.Namespace) -> bool:
    return not adapter_names(args) or args.base_fraction > 0


def run_bench(args: argparse.Namespace) -> dict:
    """Run one benchmark; returns the run dict (also written to --result-json)."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before, not after, the run
        raise SystemExit("loraserve bench: --plot needs matplotlib: "
                         "pip install 'loraserve[bench]'")
    base = args.model or ""
    if not base and _needs_base(args):
        base = asyncio.run(fetch_base_model(args.base_url, args.api_key))
    cfg = workload_config(args, base)
    requests = generate_workload(cfg)

    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req")
    results, wall = asyncio.run(run_requests(
        requests, args.base_url, api_key=args.api_key, max_concurrency=args.max_concurrency,
        timeout=args.timeout, temperature=args.temperature, include_usage=not args.no_usage,
        on_done=(lambda _: bar.update(1)) if bar else None,
    ))
    if bar:
        bar.close()

    label = args.label or f"{cfg.adapter_dist} rate={cfg.request_rate:g}"
    # Plain values only: the lead's parser may hang callables (subcommand handlers) on args.
    config = {k: v for k, v in vars(args).items()
              if k != "api_key" and isinstance(v, str | int | float | bool | list | tuple | None)}
    config.update(base_model=base, adapters=list(cfg.adapters))
    if config["request_rate"] == float("inf"):
        config["request_rate"] = "inf"  # strict JSON has no Infinity
    run = {
        "label": label,
        "config": config,
        "summary": summarize(results, wall),
        "per_adapter": per_adapter(results),
        "requests": [r.to_dict() for r in results],
    }
    if args.result_json:
        write_json(run, args.result_json)
    if args.plot:
        plot_cdfs({label: run}, args.plot)
    if not args.quiet:
        print(format_summary(run))
    return run


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m loraserve.bench",
                                description="Load generator for OpenAI-compatible servers")
    return run_bench(add_bench_args(p).parse_args(argv))
