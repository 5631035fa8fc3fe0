"""A configuration field that is also a command-line flag."""

from __future__ import annotations

from dataclasses import field


def knob(default, help_text: str, choices=None, off_flag: str | None = None):
    """A knob: its default and the help text its generated CLI flag shows. A bool
    that defaults to True is turned off by `off_flag` (e.g. --disable-prefix-cache)."""
    return field(default=default, metadata={"help": help_text, "choices": choices,
                                            "off_flag": off_flag})
