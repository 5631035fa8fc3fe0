"""`loraserve serve | generate | bench` — the command line, and `serve`'s composition root.

Engine and cluster flags are generated from the configs' fields (cli_flags.py; config/ holds
every default and help text); the server's own flags live in server/cli_args.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Callable

from loraserve.cli_flags import (
    HelpFormatter,
    add_cluster_args,
    add_engine_args,
    cluster_config_from_args,
    engine_config_from_args,
    lora_paths,
    usage_error,
)
from loraserve.config import EngineConfig


def _precheck_serve(args: argparse.Namespace, adapters: dict[str, str]) -> None:
    """What can be checked in a second, before the model takes its time to load: the port is
    free and every --lora-paths entry has a valid name and a readable adapter config."""
    import socket

    from loraserve.adapters.format import read_adapter_config
    from loraserve.types import LoraServeError, is_valid_adapter_name

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((args.host, args.port))
        except OSError as e:
            raise usage_error("serve", f"cannot listen on {args.host}:{args.port}: "
                                       f"{e.strerror}") from e
    for name, path in adapters.items():
        if not is_valid_adapter_name(name):
            raise usage_error("serve", f"--lora-paths: invalid adapter name {name!r} (use "
                                       "1-64 of [A-Za-z0-9._-])")
        try:
            read_adapter_config(path)
        except LoraServeError as e:
            raise usage_error("serve", f"--lora-paths {name}={path}: {e}") from e


def cmd_generate(args: argparse.Namespace) -> int:
    from loraserve import LLM, SamplingParams
    from loraserve.types import LoraServeError

    config = engine_config_from_args(args)
    adapters = lora_paths(args.lora_paths, "generate")
    prompts = [[{"role": "user", "content": p}] if args.chat else p for p in args.prompt]
    try:  # a missing model, a bad adapter, an unknown --lora: one line, not a traceback
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                ignore_eos=args.ignore_eos, stop=tuple(args.stop or ()))
        llm = LLM(args.model, lora_paths=adapters, **dataclasses.asdict(config))
        outs = llm.generate(prompts, params, lora=args.lora)
    except OSError as e:  # no such model; an unusable (full, read-only) cache directory
        from loraserve.paths import describe_os_error

        raise usage_error("generate", describe_os_error(e)) from e
    except (LoraServeError, ValueError) as e:
        raise usage_error("generate", str(e).strip("'\"")) from e
    for prompt, out in zip(args.prompt, outs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "lora": args.lora, "text": out.text,
                              "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason.value}))
        else:
            print(out.text)
    return 0


def cmd_serve(args: argparse.Namespace, on_ready: Callable[[], None] | None = None) -> int:
    """Build the engine, load --lora-paths, and serve the app with uvicorn. Start-up says
    what it is doing as it goes; `on_ready` runs once the server listens."""
    from loraserve.config.openmp import in_passing_thread, prefer_spinning_workers

    prefer_spinning_workers()  # before torch loads (config/openmp.py says why)
    from loraserve.server.cli_args import H11_MAX_EVENT_BYTES, configure_logging, settings_from_args

    configure_logging(args.log_level)
    log = logging.getLogger("loraserve.server")
    try:
        settings = settings_from_args(args)  # refuses unsafe flag combinations
        if settings.api_keys_file:  # a bad keys file stops the start, in one line
            from loraserve.server.api_keys import KeyRing

            KeyRing(settings.api_keys_file, (settings.api_key, settings.admin_api_key))
    except ValueError as e:
        raise usage_error("serve", str(e)) from e
    config = engine_config_from_args(args)
    adapters = lora_paths(args.lora_paths)
    cluster = cluster_config_from_args(args)
    if cluster.enabled and importlib.util.find_spec("ray") is None:
        raise usage_error("serve", "--replicas/--ray-address need Ray Serve: "
                                   "pip install 'loraserve[cluster]'")
    _precheck_serve(args, adapters)
    if cluster.enabled:
        return _serve_cluster(args, settings, config, cluster, adapters, on_ready)

    import uvicorn

    from loraserve.engine.async_engine import AsyncEngine
    from loraserve.server.app import create_app
    from loraserve.server.send_buffer import bounded_h11_protocol
    from loraserve.server.shutdown import GracefulServer
    from loraserve.server.startup_heap import freeze_startup_heap

    # built on a thread that ends, so that the engine thread's OpenMP team is the only one
    engine = in_passing_thread(_load_engine, args.model, config, adapters, log)
    log.info("model %s from %s; %d adapters; LoRA backend %s; runtime adapter updates %s",
             engine.info.model_name, engine.info.model_path, engine.store.num_registered,
             engine.info.lora_backend, "on" if settings.runtime_lora_updates else "off")
    app = create_app(AsyncEngine(engine), settings)
    log.debug("%d start-up objects frozen out of the garbage collector", freeze_startup_heap())
    http = bounded_h11_protocol(args.send_buffer_bytes) if args.send_buffer_bytes > 0 else "h11"
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, http=http,
                               log_level=args.log_level,
                               h11_max_incomplete_event_size=H11_MAX_EVENT_BYTES)

    def ready() -> None:
        log.info("ready: serving %s and %d adapters on http://%s:%d", engine.info.model_name,
                 engine.store.num_registered, args.host, args.port)
        if on_ready is not None:
            on_ready()

    GracefulServer(uv_config, app.state.ctx, args.shutdown_timeout, ready).run()
    return 0


def _load_engine(model: str | None, config: EngineConfig, adapters: dict[str, str],
                 log: logging.Logger):
    """The engine with its start-up adapters, each step logged: the model's checkpoint (a
    GGUF is converted once into the cache), its weights and kernels (C kernels are compiled
    once per CPU into the cache), then the adapters; progress bars in a terminal."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from loraserve.engine.engine import LLMEngine
    from loraserve.model.bundled import resolve_model_path
    from loraserve.paths import cache_root, describe_os_error
    from loraserve.types import LoraServeError

    log.info("finding the model (%s)", model or "the bundled SmolLM2-135M-Instruct")
    try:
        path = resolve_model_path(model)  # a GGUF file converts here, once
        log.info("loading %s: weights, KV cache, kernels (built once for this CPU into %s)",
                 path, cache_root() / "kernels")
        start = time.monotonic()
        engine = LLMEngine(path, config)
    except OSError as e:  # no such model; an unusable cache directory
        raise usage_error("serve", describe_os_error(e)) from e
    except ValueError as e:  # not a checkpoint, unsupported
        raise usage_error("serve", str(e)) from e
    log.info("model loaded in %.1f s", time.monotonic() - start)
    with logging_redirect_tqdm():
        bar = tqdm(adapters.items(), desc="loading adapters", unit="adapter",
                   disable=None if len(adapters) > 1 else True)  # None: in a terminal only
        for name, adapter_path in bar:
            try:
                engine.load_lora_adapter(name, adapter_path)
            except LoraServeError as e:  # a bad adapter at startup stops the server, clearly
                raise usage_error("serve", f"--lora-paths {name}={adapter_path}: {e}") from e
    return engine


def _serve_cluster(args, settings, config, cluster, adapters: dict[str, str],
                   on_ready: Callable[[], None] | None) -> int:
    """N replicas behind one ingress (Ray Serve); Ray is imported only on this path."""
    try:
        from loraserve.cluster.launch import serve_cluster
        from loraserve.cluster.spec import ClusterSpec
    except ImportError as e:
        raise usage_error("serve", f"--replicas/--ray-address need Ray Serve: pip install "
                                   f"'loraserve[cluster]' ({e})") from e
    spec = ClusterSpec(model=args.model, engine=config, settings=settings, cluster=cluster,
                       adapters=tuple(adapters.items()), shutdown_timeout_s=args.shutdown_timeout)
    return serve_cluster(spec, args.host, args.port, on_ready)


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

    g = sub.add_parser("generate", help="generate offline for one or more prompts",
                       formatter_class=HelpFormatter)
    # --seed here is the requests' sampling seed (the engine's default seed stays 0)
    add_engine_args(g, exclude=frozenset({"seed"}))
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--lora", default=None, help="adapter name for every prompt (default: base)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="-1: no top-k")
    g.add_argument("--seed", type=int, default=None, help="sampling seed of every prompt")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence tokens")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       formatter_class=HelpFormatter)
    add_engine_args(s)
    add_server_args(s)
    add_cluster_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="load generator against an OpenAI-compatible server",
                       formatter_class=HelpFormatter)
    add_bench_args(b)
    b.set_defaults(func=lambda a: (run_bench(a), 0)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
