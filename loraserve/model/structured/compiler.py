"""StructuredOutput -> a compiled grammar for one tokenizer, validated, cached by spec.

Compiling runs on whichever thread calls it (the server: an executor thread, before the
request reaches the engine; llguidance drops the GIL while it builds the grammar). Each request
gets its own matcher, a copy of the cached one in its initial state, which then advances with
the request's tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import llguidance.hf

from loraserve.types import LoraServeError, StructuredOutput

# Bounded whitespace: one space after ',' and ':' and nowhere else. A JSON grammar that allows
# any whitespace lets a sampled model emit newlines until max_tokens. These override any
# "x-guidance" options a client puts into its schema.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(LoraServeError):
    """The constraint cannot be compiled (bad schema, regex or grammar, or an unsupported
    keyword): the request is refused with this message."""

    status = 400
    code = "invalid_structured_output"


class CompiledGrammar:
    """A validated grammar; `new_matcher()` is a fresh matcher for one request."""

    def __init__(self, spec: StructuredOutput, matcher: llguidance.LLMatcher):
        self.spec = spec
        self._initial = matcher  # never advanced: only copied

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._initial.deep_copy()


class GrammarCompiler:
    """Compiles constraints against one tokenizer (so the cache key is effectively
    (tokenizer, kind, spec)). Thread-safe. `vocab_size`: the width of the model's logits,
    which may exceed the tokenizer's ids (those extra ids are never allowed)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = 256):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(t for t in set(eos_token_ids) if 0 <= t < vocab_size)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built at first use (about a second)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        key = (spec.kind, spec.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured output ({spec.kind}) cannot be compiled: "
                               f"{matcher.get_error()}")
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for a constraint (not yet checked against a tokenizer)."""
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object or a boolean")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"the JSON schema cannot be compiled: {e}") from e
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes, so json.dumps quotes any text exactly.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(spec.spec)
