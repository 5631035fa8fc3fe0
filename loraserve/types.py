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

    def __post_init__(self) -> None:
        # Accept lists for convenience while keeping the object hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)  # greedy, exactly
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got a {self.seed.bit_length()}"
                             "-bit integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    logprobs: list[float] | None = None  # chosen-token logprob per output token, if asked
    top_logprobs: list[dict[int, float]] | None = None
    holdback: int = 0  # trailing chars of `text` that may begin a stop string: not streamed yet

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


class RequestTooLargeError(LoraServeError):
    status = 400
    code = "request_too_large"
