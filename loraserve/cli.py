"""`loraserve serve | generate | bench` — the command line, and `serve`'s composition root.

Engine flags are generated from `EngineConfig`'s fields (config.py holds every default and
help text); the server's own flags live in server/cli_args.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from loraserve.config import EngineConfig

_TYPES = {"int": int, "float": float, "str": str}


def _lora_paths(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-paths expects NAME=PATH, got {item!r}")
        out[name] = path
    return out


def add_engine_args(p: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()) -> None:
    """--model, --lora-paths and one flag per EngineConfig field (--field-name)."""
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--lora-paths", nargs="*", metavar="NAME=PATH", help="adapters to load")
    g = p.add_argument_group("engine")
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in exclude]
    p.set_defaults(engine_fields=tuple(f.name for f in fields))
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if str(f.type) == "bool":
            g.add_argument(flag, action="store_true", default=f.default, help=help_text)
            continue
        base = str(f.type).split("|")[0].strip()  # "int | None" -> int
        if "default" not in help_text:
            help_text += f" (default: {f.default})"
        g.add_argument(flag, type=_TYPES[base], default=f.default,
                       choices=f.metadata.get("choices"), help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; an invalid value ends the command clearly."""
    values = {name: getattr(args, name) for name in args.engine_fields}
    try:
        return EngineConfig(**values)
    except ValueError as e:
        raise SystemExit(f"loraserve {args.command}: {e}") from e


def cmd_generate(args: argparse.Namespace) -> int:
    from loraserve import LLM, SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(args.model, lora_paths=_lora_paths(args.lora_paths),
              **dataclasses.asdict(config))
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


def cmd_serve(args: argparse.Namespace) -> int:
    """Build the engine, load --lora-paths, and serve the app with uvicorn."""
    from loraserve.server.cli_args import H11_MAX_EVENT_BYTES, configure_logging, settings_from_args

    configure_logging(args.log_level)
    log = logging.getLogger("loraserve.server")
    try:
        settings = settings_from_args(args)  # refuses unsafe flag combinations
    except ValueError as e:
        raise SystemExit(f"loraserve serve: {e}") from e
    config = engine_config_from_args(args)

    import uvicorn

    from loraserve.engine.async_engine import AsyncEngine
    from loraserve.engine.engine import LLMEngine
    from loraserve.server.app import create_app
    from loraserve.types import LoraServeError

    engine = LLMEngine(args.model, config)
    for name, path in _lora_paths(args.lora_paths).items():
        try:
            engine.load_lora_adapter(name, path)
        except LoraServeError as e:  # a bad adapter at startup stops the server, clearly
            raise SystemExit(f"loraserve serve: --lora-paths {name}={path}: {e}") from e
    log.info("model %s from %s; %d adapters; LoRA backend %s; runtime adapter updates %s",
             engine.info.model_name, engine.info.model_path, engine.store.num_registered,
             engine.info.lora_backend, "on" if settings.runtime_lora_updates else "off")
    app = create_app(AsyncEngine(engine), settings)
    uvicorn.run(app, host=args.host, port=args.port, http="h11", log_level=args.log_level,
                h11_max_incomplete_event_size=H11_MAX_EVENT_BYTES, timeout_graceful_shutdown=5)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("loraserve")
    except PackageNotFoundError:  # run from a source tree without installing
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from loraserve.bench.cli import add_bench_args, run_bench
    from loraserve.server.cli_args import add_server_args

    parser = argparse.ArgumentParser(prog="loraserve", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"loraserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate offline for one or more prompts")
    # --seed here is the requests' sampling seed (the engine's default seed stays 0)
    add_engine_args(g, exclude=frozenset({"seed"}))
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--lora", default=None, help="adapter name for every prompt (default: base)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None, help="sampling seed of every prompt")
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    add_server_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="load generator against an OpenAI-compatible server")
    add_bench_args(b)
    b.set_defaults(func=lambda a: (run_bench(a), 0)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
