"""`loraserve serve`'s server flags (limits, keys, runtime-adapter policy) and logging.

The engine's flags and the composition root (build the engine, run uvicorn) are in cli.py."""

from __future__ import annotations

import argparse
import logging
import sys

H11_MAX_EVENT_BYTES = 64 * 1024  # request line + headers: a huge header is refused by h11


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    g.add_argument("--admin-api-key", default=None,
                   help="enable runtime adapter load/unload, for requests bearing THIS key")
    g.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="tenant keys (JSON): each key's name, the adapters it may see and use, "
                        "and its limits (max_concurrent, requests_per_minute, "
                        "tokens_per_minute; over one: 429 + Retry-After); reloaded on SIGHUP "
                        "and POST /v1/reload_api_keys")
    g.add_argument("--allow-runtime-lora-updates", action="store_true",
                   help="enable runtime adapter load/unload without a key (loopback host only)")
    g.add_argument("--lora-root", default=None, metavar="DIR",
                   help="runtime loads must resolve (symlinks followed) inside DIR")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body; a larger one gets a 413")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt a request may send, in tokens (default: the "
                        "model's context length)")
    g.add_argument("--max-tokens-limit", type=int, default=4096,
                   help="largest max_tokens a request may ask for")
    g.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    g.add_argument("--served-model-name", action="append", default=None,
                   help="another name clients may use for the base model (repeatable)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long requests in flight may take to finish "
                        "before they end with a 503 (new requests get a 503 at once)")
    g.add_argument("--send-buffer-bytes", type=int, default=32 * 1024, metavar="BYTES",
                   help="data buffered per connection for a client (in the server and in the "
                        "socket, each): a client that does not read its stream is noticed "
                        "after this much and its request leaves the batch "
                        "(--max-unread-outputs); 0: the operating system's default")
    g.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="log level of the server and of loraserve's own loggers")


def settings_from_args(args: argparse.Namespace):
    from loraserve.server.settings import ServerSettings

    names = tuple(args.served_model_name or ()) + ((args.model,) if args.model else ())
    return ServerSettings(
        host=args.host, api_key=args.api_key, admin_api_key=args.admin_api_key,
        api_keys_file=args.api_keys_file,
        allow_runtime_lora_updates=args.allow_runtime_lora_updates, lora_root=args.lora_root,
        max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit, max_n=args.max_n, served_model_names=names)


def configure_logging(level: str) -> None:
    # loraserve.* loggers (adapter loaded/evicted/reloaded) go to stderr next to uvicorn's.
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
