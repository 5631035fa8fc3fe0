"""Leaf value types shared by every layer. No torch, no imports from the package."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum

# Adapter names: letters, digits, '.', '_' and '-' only; ':' is reserved for 'base:adapter'.
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def is_valid_adapter_name(name: object) -> bool:
    """The whole name matches (a trailing newline does not slip past '$'), and it is not made
    of dots only ('.', '..' read as directories wherever a name meets a path)."""
    return (isinstance(name, str) and ADAPTER_NAME_RE.fullmatch(name) is not None
            and name.strip(".") != "")
# Below this a temperature means greedy: dividing logits by it would overflow (vLLM's
# _SAMPLING_EPS); a seed must fit torch.Generator.manual_seed.
SAMPLING_EPS = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # client gone or aborted by the caller
    ERROR = "error"  # the request failed (e.g. its adapter failed to load)
    # its grammar allowed no token that its other sampling fields allowed (e.g. stop ids it
    # needed were masked by min_tokens): the output is cut where it was, never sampled from NaN
    GRAMMAR_DEAD_END = "grammar_dead_end"


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text, compiled into a grammar per tokenizer.

    kind: "json" (spec: a JSON schema, as JSON text), "regex", "choice" (spec: a JSON list of
    strings) or "grammar" (spec: a Lark grammar, llguidance's dialect)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, "
                             f"got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError("structured output spec must be a string")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k>0: also the top-k
    # Per prompt token (from the second): its logprob under the model, and with k>0 the top-k
    # at its position. Such a request computes its whole prompt (no prefix-cache reuse).
    prompt_logprobs: int | None = None
    # vLLM semantics (see model/logits_processors.py): penalties on the raw logits, min_p
    # after the temperature, logit_bias as (token id, bias) pairs sorted by id.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # EOS and stop ids/strings cannot end the output before this many
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutput | None = None  # output constrained to a grammar

    def __post_init__(self) -> None:
        # Accept lists for convenience while keeping the object hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0 (0: score the prompt, generate nothing)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)  # greedy, exactly
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got a {self.seed.bit_length()}"
                             "-bit integer")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {k}")
        self._check_logits_processing()

    def _check_logits_processing(self) -> None:
        def within(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
            if not ok:
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], "
                                 f"got {v}")

        within("repetition_penalty", 0.0, 2.0, lo_open=True)
        within("presence_penalty", -2.0, 2.0)
        within("frequency_penalty", -2.0, 2.0)
        within("min_p", 0.0, 1.0)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else (bias or ())
        pairs = tuple(sorted((int(t), float(b)) for t, b in pairs))
        if len(pairs) > 300:
            raise ValueError("logit_bias: at most 300 tokens")
        for t, b in pairs:
            if t < 0 or not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias: token {t} must be >= 0 and its bias in "
                                 f"[-100, 100], got {b}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias: a token appears twice")
        object.__setattr__(self, "logit_bias", pairs)

    @property
    def processes_logits(self) -> bool:
        """Whether anything beyond temperature/top-k/top-p touches this request's logits."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.min_tokens or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's logprob under the model, given the tokens before it."""

    logprob: float
    rank: int  # 1 = the most likely token at that position
    top: tuple[tuple[int, float], ...] = ()  # the top-k (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """What a caller sees of one request: the whole output so far (or final)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_status: int | None = None  # with an error: 4xx the client's adapter, 500 a bug
    lora_name: str | None = None
    adapter_version: int | None = None  # lora_name's version these tokens come from
    logprobs: list[float] | None = None  # chosen-token logprob per output token, if asked
    # with prompt_logprobs: per prompt token, None for the first, else (its logprob, top-k)
    prompt_logprobs: list[PromptLogprob | None] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    holdback: int = 0  # trailing chars of `text` that may begin a stop string: not streamed yet
    num_cached_tokens: int = 0  # prompt tokens whose K/V were reused (prefix cache or a fork)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class LoraServeError(Exception):
    """Base of errors a client caused; `status` is the HTTP status it maps to."""

    status = 400
    code = "invalid_request"


class AdapterNotFoundError(LoraServeError):
    status = 404
    code = "adapter_not_found"


class AdapterConflictError(LoraServeError):
    status = 409
    code = "adapter_conflict"


class AdapterBusyError(LoraServeError):
    """A passing condition, not the client's mistake: host memory is full of adapters in use
    or pinned. Retry after a moment (503 + Retry-After)."""

    status = 503
    code = "adapters_busy"
    retry_after_s = 1


class AdapterFormatError(LoraServeError):
    """The adapter on disk is missing, corrupt, unsupported or does not fit the base model."""

    status = 400
    code = "invalid_adapter"


class AdapterFilesChangedError(LoraServeError):
    """The adapter's files changed on disk while they were being read (a file vanished or was
    replaced): the operator's files moving underneath, not a mistake in the request. Retry
    when they are in place."""

    status = 409
    code = "adapter_files_changed"


class AdapterLoadCancelledError(LoraServeError):
    """The load was stopped because the server is shutting down."""

    status = 503
    code = "server_unavailable"
    retry_after_s = 5


class RequestTooLargeError(LoraServeError):
    status = 400
    code = "request_too_large"
