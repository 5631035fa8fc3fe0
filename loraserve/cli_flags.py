"""The command line's flags: one per field of the frozen configs (EngineConfig, ClusterConfig),
their values back as configs, --lora-paths, and how a mistake on the command line ends.

config/ holds every default and help text; the server's own flags live in server/cli_args.py;
loraserve/cli.py composes the commands from these.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from loraserve.config import ClusterConfig, EngineConfig

_TYPES = {"int": int, "float": float, "str": str}


def usage_error(command: str, message: str) -> SystemExit:
    """A mistake on the command line: one line on stderr, exit status 2 (argparse's)."""
    print(f"loraserve {command}: {message}", file=sys.stderr)
    return SystemExit(2)


def lora_paths(items: list[str] | None, command: str = "serve") -> dict[str, str]:
    """--lora-paths NAME=PATH entries as {name: path}."""
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise usage_error(command, f"--lora-paths expects NAME=PATH, got {item!r}")
        out[name] = path
    return out


def add_engine_args(p: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()) -> None:
    """--model, --lora-paths and one flag per EngineConfig field (--field-name)."""
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir or GGUF file (default: the bundled "
                        "SmolLM2-135M-Instruct); README lists the families served")
    p.add_argument("--lora-paths", nargs="*", metavar="NAME=PATH", help="adapters to load")
    g = p.add_argument_group("engine")
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in exclude]
    p.set_defaults(engine_fields=tuple(f.name for f in fields))
    _add_config_flags(g, fields)


def _add_config_flags(g: argparse._ArgumentGroup, fields: list[dataclasses.Field]) -> None:
    """One flag per frozen-config field (--field-name): its default and help from the field."""
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if str(f.type) == "bool" and f.default:
            g.add_argument(f.metadata["off_flag"], dest=f.name, action="store_false",
                           default=True, help=f"turn off {help_text} (on by default)")
            continue
        if str(f.type) == "bool":
            g.add_argument(flag, action="store_true", default=f.default, help=help_text)
            continue
        base = str(f.type).split("|")[0].strip()  # "int | None" -> int
        g.add_argument(flag, type=_TYPES[base], default=f.default,
                       choices=f.metadata.get("choices"), help=help_text)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """One flag per ClusterConfig field: scale-out over Ray Serve (loraserve/cluster/)."""
    _add_config_flags(p.add_argument_group("cluster"), list(dataclasses.fields(ClusterConfig)))


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ClusterConfig)}
    try:
        return ClusterConfig(**values)
    except ValueError as e:
        raise usage_error(args.command, str(e)) from e


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; an invalid value ends the command clearly."""
    values = {name: getattr(args, name) for name in args.engine_fields}
    try:
        return EngineConfig(**values)
    except ValueError as e:
        raise usage_error(args.command, str(e)) from e


class HelpFormatter(argparse.HelpFormatter):
    """--help shows every flag's default, unless its text already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is None
                or isinstance(action.default, bool) or action.default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"
