"""PEFT's regexes run on RE2 with Python's meaning (adapters/peft/linear_regex.py): the same
matches as `re` on module names, the constructs RE2 cannot run refused by name, and the
patterns that make `re` backtrack for seconds answered at once."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.adapters.peft.linear_regex import PatternRefused, compile_linear

NAMES = [f"model.layers.{i}.{p}.{m}" for i in (0, 1, 12)
         for p, m in (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "up_proj"),
                      ("mlp", "gate_up_proj"))] + ["model", "lm_head", "model.layers.3.mlp",
                                                  "model.embed_tokens", "Q_PROJ", "a{,3}"]


def agree(pattern: str) -> None:
    ours = compile_linear(pattern)
    for name in NAMES:
        assert bool(ours.fullmatch(name)) == bool(re.fullmatch(pattern, name)), (pattern, name)
        assert bool(ours.match(name)) == bool(re.match(pattern, name)), (pattern, name)


@pytest.mark.parametrize("pattern", [
    r"model\.layers\.1\.(self_attn\.(q|k)_proj|mlp\.up_proj)", r".*\.(q|o)_proj",
    r"(?i)q_proj|.*\.Q_PROJ", r"(?i:Q)_proj", "a{,3}", "a{,3}.*", r"[[:alpha:]]+",
    r".*\Z", r"^model$", r"\w+(\.\d+)?\..*", r"[^.]*\.[^.]*", r"model\b.*", r"(?s).*",
    r".*up_proj\Z", r"(?x) model \. layers .*", r"\S+", r"[\W\d]+", "",
])
def test_same_matches_as_python_re(pattern):
    agree(pattern)


def test_peft_composed_patterns_keep_their_groups():
    """PEFT's layers_pattern regex is read back by group name."""
    ours = compile_linear(r"(?:^|.*?\.)layers\.(?P<idx>\d+)\.")
    assert ours.match("model.layers.12.mlp.up_proj").group("idx") == "12"


_PIECES = st.sampled_from(["a", "q", "_", r"\.", ".", "proj", "layers", r"\d", r"\w", "[a-p]",
                           "[^.]", "(", ")", "|", "*", "+", "?", "{1,2}", "{,2}", "^", "$",
                           r"\b", "(?i:Q)", "model"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, min_size=1, max_size=8).map("".join))
def test_random_patterns_agree_with_python_re(pattern):
    try:
        re.compile(pattern)
    except re.error:
        with pytest.raises(PatternRefused):
            compile_linear(pattern)
        return
    try:
        compile_linear(pattern)
    except PatternRefused as e:  # possessive repeats ('a*+'): refused, never mismatched
        assert "linear time" in str(e)
        return
    agree(pattern)


@pytest.mark.parametrize("pattern,why", [
    (r"(a)\1", "backreference"), (r"(?=q)q_proj", "lookaround"), (r"(?<!x)q", "lookaround"),
    (r"q_proj++", "possessive"), (r"(?>q)", "atomic"), (r"(a)?(?(1)b|c)", "conditional"),
    ("a{1001}", "more than 1000"), ("(", "invalid"), ("x" * 1001, "longer than"),
    ("(?:a{1000}){1000}", "too large"), (r"\z", "invalid"),
])
def test_refused_patterns_are_named(pattern, why):
    with pytest.raises(PatternRefused, match=why):
        compile_linear(pattern)


@pytest.mark.parametrize("pattern", [".*" * 9 + "Z", r"(\w+\.?)+_projZ", r"(a|aa)*b",
                                     r"(.*)*(.*)*(.*)*Z"])
def test_backtracking_patterns_match_in_linear_time(pattern):
    subject = "model.layers.0.self_attn.q_proj" * 20 + "a" * 200
    t0 = time.monotonic()
    ours = compile_linear(pattern)
    assert ours.fullmatch(subject) is None and ours.match(subject) is None
    assert time.monotonic() - t0 < 1.0  # Python's re takes seconds to minutes here
