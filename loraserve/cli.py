"""`loraserve serve | generate | bench` — the command line."""

from __future__ import annotations

import argparse
import json
import sys


def _lora_paths(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-paths expects NAME=PATH, got {item!r}")
        out[name] = path
    return out


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--lora-paths", nargs="*", metavar="NAME=PATH", help="adapters to load")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--lora-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="adapter weights in compute memory (auto: the model's, float32)")
    p.add_argument("--max-loras-prefetch", type=int, default=0)
    p.add_argument("--allow-pickle-adapters", action="store_true",
                   help="also read adapter_model.bin (pickle: runs code from the file)")
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        max_lora_rank=args.max_lora_rank,
        lora_dtype=args.lora_dtype,
        max_loras_prefetch=args.max_loras_prefetch,
        allow_pickle_adapters=args.allow_pickle_adapters,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from loraserve import LLM, SamplingParams

    llm = LLM(args.model, lora_paths=_lora_paths(args.lora_paths), **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos, stop=tuple(args.stop or ()))
    prompts = [[{"role": "user", "content": p}] if args.chat else p for p in args.prompt]
    outs = llm.generate(prompts, params, lora=args.lora)
    for prompt, out in zip(args.prompt, outs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "lora": args.lora, "text": out.text,
                              "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason.value}))
        else:
            print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate offline for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--lora", default=None, help="adapter name for every prompt (default: base)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    try:
        from loraserve.server.cli_args import add_server_args, cmd_serve
    except ImportError:  # the server arrives with its own module
        pass
    else:
        add_server_args(s)
        s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="load generator against an OpenAI-compatible server")
    from loraserve.bench.cli import add_bench_args, run_bench

    add_bench_args(b)
    b.set_defaults(func=lambda a: (run_bench(a), 0)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not hasattr(args, "func"):
        raise SystemExit(f"loraserve {args.command}: not available")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
