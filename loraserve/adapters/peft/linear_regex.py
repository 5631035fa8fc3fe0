"""PEFT's regexes, matched in linear time by RE2 with Python's meaning.

PEFT matches adapter-config patterns with Python's backtracking `re` on module names; a
pattern like `(.*)*Z` then takes exponential time, holding the GIL. Here Python's own parser
reads the pattern (so it means exactly what it means to PEFT) and the parse tree is written
out again in RE2's syntax, which matches in time linear in the subject and releases the GIL.
Where the two syntaxes read the same text differently (`a{,3}`, `[[:alpha:]]`, `\\Z`) the tree,
not the text, decides. What RE2 cannot run in linear time (backreferences, lookarounds,
conditionals, atomic groups, possessive repeats, repeats over 1000) is refused, naming the
construct.

The subjects are always our own module names: ASCII, no newline. On them every single-character
node is translated into the exact set of ASCII characters Python's `re` accepts there (case
folding, Unicode classes and flags included), and `^`/`$` mean the start and end of the text.
"""

from __future__ import annotations

import re
import string
import warnings
from functools import lru_cache
from re import _compiler as sre_compile  # the compiler `re.compile` itself uses
from re import _constants as C
from re import _parser as sre

MAX_PATTERN_CHARS = 1000
MAX_REPEAT = 1000  # RE2's largest counted repetition
_RE2_MEMORY = 4 << 20  # per compiled pattern: RE2 refuses a program that needs more
_ASCII = "".join(map(chr, range(128)))
_PLAIN = frozenset(string.ascii_letters + string.digits + "_")
_CHAR_NODES = (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN)
_REFUSED = {
    C.GROUPREF: "a backreference", C.GROUPREF_EXISTS: "a conditional group",
    C.ASSERT: "a lookaround", C.ASSERT_NOT: "a lookaround",
    C.ATOMIC_GROUP: "an atomic group", C.POSSESSIVE_REPEAT: "a possessive repeat",
}
_AT = {C.AT_BEGINNING: "^", C.AT_BEGINNING_STRING: "^", C.AT_BEGINNING_LINE: "^",
       C.AT_END: "$", C.AT_END_STRING: "$", C.AT_END_LINE: "$",
       C.AT_BOUNDARY: r"\b", C.AT_NON_BOUNDARY: r"\B",
       C.AT_UNI_BOUNDARY: r"\b", C.AT_UNI_NON_BOUNDARY: r"\B",
       C.AT_LOC_BOUNDARY: r"\b", C.AT_LOC_NON_BOUNDARY: r"\B"}


class PatternRefused(ValueError):
    """The pattern is invalid for Python's `re`, or not expressible in linear time."""


def compile_linear(pattern: str):
    """`pattern` (Python syntax) as a compiled RE2 regex with the same matches on module
    names. Its `match`/`fullmatch` stand in for `re.match`/`re.fullmatch`."""
    return _compile(pattern)


@lru_cache(maxsize=4096)
def _compile(pattern: str):
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternRefused(f"longer than {MAX_PATTERN_CHARS} characters")
    try:
        with warnings.catch_warnings():  # "possible nested set": the tree below is exact
            warnings.simplefilter("ignore")
            parsed = sre.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise PatternRefused(f"invalid: {e}") from None
    names = {i: n for n, i in parsed.state.groupdict.items()}
    text = _emit(parsed.data, parsed.state.flags, names)
    try:  # imported here: configs without regexes load where google-re2 is not installed
        import re2
    except ImportError:
        raise PatternRefused("this server cannot match regexes safely: google-re2 is not "
                             "installed (pip install google-re2)") from None
    options = re2.Options()
    options.max_mem = _RE2_MEMORY
    options.log_errors = False
    try:
        return re2.compile(text, options)
    except re2.error as e:
        raise PatternRefused(f"too large for the linear-time matcher ({e})") from None


def _emit(items, flags: int, names: dict[int, str]) -> str:
    out = []
    for op, arg in items:
        if op in _REFUSED:
            raise PatternRefused(f"it uses {_REFUSED[op]}, which cannot be matched in linear "
                                 "time")
        if op in _CHAR_NODES:
            out.append(_char_class(op, tuple(arg) if op is C.IN else arg, flags))
        elif op is C.AT:
            out.append(_AT[arg])
        elif op is C.BRANCH:
            out.append("(?:" + "|".join(_emit(b, flags, names) for b in arg[1]) + ")")
        elif op is C.SUBPATTERN:
            group, add, drop, body = arg
            inner = _emit(body, (flags | add) & ~drop, names)
            if group is None:
                out.append(f"(?:{inner})")
            elif group in names:
                out.append(f"(?P<{names[group]}>{inner})")
            else:
                out.append(f"({inner})")
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, body = arg
            if lo > MAX_REPEAT or (hi is not C.MAXREPEAT and hi > MAX_REPEAT):
                raise PatternRefused(f"it repeats more than {MAX_REPEAT} times")
            count = f"{{{lo},}}" if hi is C.MAXREPEAT else f"{{{lo},{hi}}}"
            lazy = "?" if op is C.MIN_REPEAT else ""
            out.append(f"(?:{_emit(body, flags, names)}){count}{lazy}")
        else:
            raise PatternRefused(f"it uses {op}, which the linear-time matcher does not take")
    return "".join(out)


@lru_cache(maxsize=16384)
def _char_class(op, arg, flags: int) -> str:
    """One character's node as an RE2 class of the ASCII characters Python accepts there."""
    state = sre.State()
    state.flags = flags
    node = sre.SubPattern(state, [(op, list(arg) if op is C.IN else arg)])
    accepted = sre_compile.compile(node, flags).findall(_ASCII)
    if not accepted:
        return r"[^\x00-\x{10FFFF}]"  # nothing
    if len(accepted) == 1:
        return _escape(accepted[0])
    runs, codes = [], [ord(c) for c in accepted]  # findall returns them in order
    start = prev = codes[0]
    for c in [*codes[1:], None]:
        if c != prev + 1 if c is not None else True:
            runs.append(_escape(chr(start)) if start == prev else
                        f"{_escape(chr(start))}-{_escape(chr(prev))}")
            start = c
        prev = c
    return "[" + "".join(runs) + "]"


def _escape(c: str) -> str:
    return c if c in _PLAIN else f"\\x{ord(c):02x}"
