"""The README's table of `loraserve serve` flags, generated from the parser itself.

    python -m loraserve.readme_flags          # rewrite the table in README.md
    python -m loraserve.readme_flags --check  # exit 1 if README.md's table is stale

The engine's flags come from `EngineConfig` (config/engine.py: every default and help text), the
server's from server/cli_args.py; tests/test_readme.py fails when the README falls behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"


def serve_parser() -> argparse.ArgumentParser:
    from loraserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off"  # a switch: not given
    if action.default is None:
        return "—"
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_flags_table() -> str:
    """One row per flag of `loraserve serve`, grouped as --help groups them."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in serve_parser()._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if "--help" in action.option_strings:
            continue
        flag = " / ".join(f"`{o}`" for o in action.option_strings)
        if action.choices:
            flag += " {" + ",".join(str(c) for c in action.choices) + "}"
        rows.append(f"| {flag} | {_cell(_default(action))} | {_cell(action.help or '')} |")
    return "\n".join(rows)


def readme_table(readme: str) -> str:
    """The table now between the README's markers."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].strip("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loraserve.readme_flags")
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is stale")
    args = ap.parse_args(argv)
    text = README.read_text()
    table = render_flags_table()
    if readme_table(text) == table:
        return 0
    if args.check:
        print("README.md's flag table is stale: run python -m loraserve.readme_flags",
              file=sys.stderr)
        return 1
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    print("rewrote the flag table in", README)
    return 0


if __name__ == "__main__":
    sys.exit(main())
