"""`python -m loraserve.demo serve [loraserve serve args]` — what `make serve` runs.

Serves the bundled SmolLM2-135M-Instruct with the demo adapters (pirate, shouty, french) and,
once the server listens, prints ready-to-paste examples. Any other argument goes to
`loraserve serve` unchanged; extra `--lora-paths` are added to the demo adapters.
"""

from __future__ import annotations

import argparse
import shlex
import sys

USAGE = "usage: python -m loraserve.demo serve [loraserve serve arguments]"
QUESTION = "What is the capital of Spain?"


def _peek(extra: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The flags the banner needs, and `extra` without --lora-paths (merged with ours)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--lora-paths", nargs="*", action="extend", default=[])
    p.add_argument("--model", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    known, rest = p.parse_known_args(extra)
    for flag in ("model", "host", "port", "api_key"):
        value = getattr(known, flag)
        if value is not None and value != p.get_default(flag):
            rest += [f"--{flag.replace('_', '-')}", str(value)]
    return known, rest


def banner(model_name: str, adapters: list[str], host: str, port: int, api_key: str | None) -> str:
    # A wildcard bind address is not something a client can connect to.
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{host}:{port}"
    auth = ' -H "Authorization: Bearer $API_KEY"' if api_key else ""
    key = '"YOUR_API_KEY"' if api_key else '"unused"'
    body = ('{"model": "%s", "max_tokens": 48, "temperature": 0, "messages": '
            '[{"role": "user", "content": "%s"}]}')
    note = "\n(set API_KEY to the --api-key value)" if api_key else ""
    models = ", ".join(f'"{m}"' for m in [model_name, *adapters])
    with_adapters = f" with LoRA adapters {', '.join(adapters)}" if adapters else ""
    return f"""
loraserve demo: {model_name}{with_adapters}
serving at {url} (Ctrl-C to stop); try:{note}

  curl -s {url}/v1/models{auth}

  curl -s {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\
    -d '{body % (adapters[0] if adapters else model_name, QUESTION)}'

  curl -s {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\
    -d '{body % (model_name, QUESTION)}'

  # pip install openai, then in Python:
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key={key})
  for model in [{models}]:
      r = client.chat.completions.create(model=model, max_tokens=48, temperature=0,
          messages=[{{"role": "user", "content": "{QUESTION}"}}])
      print(f"{{model}}: {{r.choices[0].message.content}}")
"""


def serve(extra: list[str]) -> int:
    from loraserve.cli import build_parser, cmd_serve
    from loraserve.cli import main as cli_main

    if {"-h", "--help"} & set(extra):
        print(USAGE + "\n")
        return cli_main(["serve", "--help"])
    known, rest = _peek(extra)

    from loraserve.model.bundled import resolve_model_path

    print("loraserve demo: preparing the model and the demo adapters; the example commands "
          "follow once the server listens", flush=True)
    model_dir = resolve_model_path(known.model)  # the bundled GGUF converts here, once
    adapters = _demo_adapters(model_dir)
    pairs = [f"{name}={path}" for name, path in adapters.items()] + known.lora_paths
    names = list(adapters) + [p.partition("=")[0] for p in known.lora_paths]
    argv = ["serve", *rest, "--lora-paths", *pairs]
    print("running: loraserve " + shlex.join(argv) + "\n", flush=True)

    def ready() -> None:
        print(banner(model_dir.name, names, known.host, known.port, known.api_key), flush=True)

    return cmd_serve(build_parser().parse_args(argv), on_ready=ready)


def _demo_adapters(model_dir) -> dict:
    """The shipped demo adapters; for another base model they are trained once, which needs
    peft (a dev dependency): without it the demo serves no demo adapters and says why."""
    from loraserve.demo.adapters import ensure_demo_adapters

    try:
        return ensure_demo_adapters(model_dir)
    except ImportError as e:
        print(f"loraserve demo: no demo adapters for {model_dir.name}: training them needs "
              f"{e.name or 'peft'} (make venv-dev installs it)", flush=True)
        return {}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
