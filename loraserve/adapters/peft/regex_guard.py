"""Regexes from adapter configs are run on our threads (PEFT's target_modules may be one), and
Python's `re` holds the GIL while it backtracks: a pattern like `(a+)+$` could stall the whole
server for seconds. Refuse the shapes that backtrack exponentially before matching anything."""

from __future__ import annotations

import re
from re import _parser as sre  # the parser `re.compile` itself uses

MAX_PATTERN_CHARS = 1000
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def unsafe_reason(pattern: str) -> str | None:
    """Why matching `pattern` could take exponential time, or None when it cannot: a repeat
    whose body holds another repeat or an alternation (nested or ambiguous quantifiers)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"longer than {MAX_PATTERN_CHARS} characters"
    try:
        parsed = sre.parse(pattern)
    except re.error as e:
        return f"invalid: {e}"
    return _scan(parsed, inside_repeat=False)


def _scan(items, inside_repeat: bool) -> str | None:
    for op, arg in items:
        if op in _REPEATS:
            lo, hi, body = arg
            repeats = hi is sre.MAXREPEAT or hi > 1
            if inside_repeat and repeats:
                return "it nests quantifiers (exponential backtracking)"
            if (why := _scan(body, inside_repeat or repeats)) is not None:
                return why
        elif op is sre.BRANCH:
            if inside_repeat:
                return "it repeats an alternation (exponential backtracking)"
            for branch in arg[1]:
                if (why := _scan(branch, inside_repeat)) is not None:
                    return why
        elif op is sre.SUBPATTERN:
            if (why := _scan(arg[-1], inside_repeat)) is not None:
                return why
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            if (why := _scan(arg[1], inside_repeat)) is not None:
                return why
    return None
